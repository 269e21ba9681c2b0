"""Continuous batching: one thread owns the model and runs decode steps for every request in flight.

Requests arrive as groups (one per prompt) and wait in one queue, in order of arrival: at most
``max_running_requests`` requests hold a running slot, at most ``max_queue`` wait for one, none longer than the
queue timeout (the rules are ``admission.Admission``'s). Between steps the scheduler admits the queue's front
groups, those whose request holds a slot, while the batch has room (``max_batch_rows`` rows, the KV blocks a
group takes now; named LoRA adapters mix in one batch, other adapter types need the same one): the batch's steps
compute each prompt in chunks beside the running rows, then it samples its first tokens and joins them. Every
step is one forward for all rows; finished candidates leave at once, and a group whose client went away is dropped
at the next step. When the rows outgrow the KV pool the newest request gives its blocks back and is computed again
later (``_make_room``). A step whose forward runs out of memory fails the newest group only and is retried for the
others.

The scheduler is the in-process engine (``client.Engine``): requests come with ``add_request`` and leave with
``abort``; each iteration's outputs, keyed by request id, go out once it ends (``deliver``: to the requests'
tickets in process, over the pipe in the engine process).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch

from app.engine.core.admission import Admission
from app.engine.core.client import Ended, Engine
from app.engine.errors import EngineError, EngineNotReady, EngineStepFailed
from app.engine.core.batches import BatchOutOfMemory, BlockBatch
from app.engine.core.prefill import ChunkedPrefill
from app.engine.core.sequence import RequestGroup, Status
from app.engine.core.step import Event, compute_chunks, decode_step, drop, drop_finished, preempt
from app.engine.model.runner import MIXED, ModelRunner
from app.engine.core.speculative import SpeculativeConfig

log = logging.getLogger("saker.scheduler")


@dataclass
class SchedulerOutput:
    """What one step computes (``Scheduler._schedule``): the groups whose rows decode (each row its next token, and
    its guesses with speculation), the prompt chunks that ride in the same forward, each job with its next tokens,
    those computed apart, one forward per PEFT adapter (nothing runs, or the rows use another adapter), and the
    groups preempted to make room for the step (their blocks given back, their rows parked)."""

    rows: list[RequestGroup] = field(default_factory=list)
    chunks: list[tuple[ChunkedPrefill, list[int]]] = field(default_factory=list)
    apart: list[list[tuple[ChunkedPrefill, list[int]]]] = field(default_factory=list)
    preempted: list[RequestGroup] = field(default_factory=list)


class Scheduler(Engine):
    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_batch_rows: int = 8,
        prefill_tokens: int = 0,
        prefill_chunk_tokens: int = 0,
        kv_cache_tokens: int | None = None,
        prefix_cache_tokens: int = 0,
        max_running_requests: int | None = None,
        max_queue: int | None = None,
        queue_timeout: float | None = None,
        speculative: SpeculativeConfig | None = None,
    ):
        super().__init__()
        self.runner = runner
        self.tokenizer, self.byte_level = runner.tokenizer, runner.byte_level
        self.max_batch_rows = max(1, max_batch_rows)
        self.kv_cache_tokens = kv_cache_tokens  # the block pool's size in positions (None: derived at first use)
        # prompt tokens one step computes, across the prompts being prefilled (the running rows' tokens count too)
        self.prefill_tokens = prefill_tokens
        # a prompt computes at most this many of its tokens per step (0: the whole prompt, budget allowing)
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._prefilling: collections.deque[ChunkedPrefill] = collections.deque()
        self.batch = BlockBatch(runner, kv_cache_tokens, prefix_cache_tokens)
        self.batch.speculation = speculative.build(runner) if speculative is not None else None
        # the one waiting queue: every request's prompts in order of arrival (preempted ones back at its head); the
        # requests holding a running slot (``admission``: at most max_running_requests) are always its front
        self._pending: collections.deque[RequestGroup] = collections.deque()
        self.admission = Admission(max_queue, queue_timeout, capacity=max_running_requests or self.max_batch_rows)
        self._requests: dict[int, list[RequestGroup]] = {}  # by request id: its groups not ended yet
        self._outputs: list[tuple[int, int, object]] = []  # this iteration's (rid, tag, payload), sent at its end
        self._held: dict[int, list[tuple[int, int, object]]] = {}  # a lazy request's outputs, until a prompt ends
        self.deliver = self.route  # where an iteration's outputs go (the engine process sends them on its pipe)
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # the loop waits on it for work
        self._quiet = threading.Condition(lock)  # ``wait_idle`` waits on it for the loop to wait
        self._waiting_for_work = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        self._arrivals = 0  # groups submitted so far: each group's ``arrival`` (the newest is preempted first)
        self.preemptions = 0  # groups whose rows left the batch for older requests' blocks (``_make_room``)
        self.max_rows_seen = 0  # the largest batch a step has served (stats and tests)
        # fault isolation: steps that failed (their requests failed, everything they held given back), leaks found
        # and repaired at an idle point, and why the engine stopped when it could not be made consistent again
        self.failures = 0
        self.repairs = 0
        self.fatal: str | None = None
        self.on_fatal = None  # called with ``fatal`` once every request heard of it (the worker exits)
        self.last_progress = time.monotonic()  # when the loop last came round (the liveness probe's clock)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="saker-scheduler", daemon=True)
        self._thread.start()

    # -- the engine interface (``client.Engine``) ---------------------------------------------------------------
    def add_request(self, rid: int, groups: list[RequestGroup], eager: bool = True) -> None:
        """Queue the groups (prompts) of request ``rid``. ``eager``: its outputs go out every iteration (a stream,
        stop strings), otherwise when one of its prompts ends."""
        for group in groups:
            group.make_grammars(self.runner)  # on the submitting thread, not the model thread
        now = time.perf_counter()
        with self._cond:
            if self.fatal is not None:
                raise EngineNotReady(self.fatal)
            self.admission.arrive(rid, now)  # QueueFull: nothing was queued
            if not self._requests:  # the loop was idle: the liveness clock starts now, not when it last ran
                self.last_progress = time.monotonic()
            self._requests[rid] = list(groups)
            for group in groups:
                group.request_id, group.eager, group.submitted = rid, eager, now
                self._arrivals += 1
                group.arrival = self._arrivals
                self._pending.append(group)
            self._cond.notify()

    def abort(self, rid: int) -> None:
        """The request's client went away: its groups leave at the next step (waiting ones when their turn comes)."""
        with self._cond:
            for group in self._requests.get(rid, ()):
                group.cancelled = True
            self._cond.notify()  # a request waiting for its slot leaves at once

    def finish(self, rid: int, tag: int, index: int) -> None:
        """A stop string ended candidate ``index`` of prompt ``tag``: its row leaves at the next step."""
        with self._cond:
            for group in self._requests.get(rid, ()):
                if group.tag == tag:
                    group.finish_candidate(index)

    def _emit(self, group: RequestGroup, events: list) -> None:
        """A group's events of this iteration (numbers), for its request's reader."""
        if events:
            item = (group.request_id, group.tag, events)
            if group.eager:
                self._outputs.append(item)
            else:
                self._held.setdefault(group.request_id, []).append(item)

    def _end(self, group: RequestGroup, error: BaseException | None = None) -> None:
        """The group is no longer the scheduler's (every row ended, it was cancelled, or it failed with ``error``):
        its request's held outputs and its end go out with this iteration."""
        group.status = Status.FINISHED
        self.batch.unpark(group)  # a preempted group that ends before it came back
        if self.batch.speculation is not None:
            self.batch.speculation.forget(group.seqs)  # a draft's blocks for its sequences
        if error is not None and not isinstance(error, (EngineError, torch.OutOfMemoryError)):
            error = EngineStepFailed("the engine failed on this request")  # what failed is in the log, not the answer
        rid = group.request_id
        self._outputs += self._held.pop(rid, [])
        self._outputs.append((rid, group.tag, Ended.of(group) if error is None else error))
        with self._cond:
            left = [g for g in self._requests.get(rid, ()) if g is not group]
            if left:
                self._requests[rid] = left
            elif self._requests.pop(rid, None) is not None:
                self.admission.leave(rid, time.perf_counter())  # its slot goes to the longest waiter

    def _flush(self) -> None:
        if self._outputs:
            outputs, self._outputs = self._outputs, []
            self.deliver(outputs)

    def queue_snapshot(self) -> dict[str, int]:
        """The waiting queue's counts: requests running (holding a slot), waiting for one, rejected, timed out."""
        with self._cond:
            return self.admission.snapshot()

    # -- the loop -------------------------------------------------------------------------------------------
    def _run(self) -> None:
        """Iterations until the engine cannot go on. An iteration that fails fails the requests it touched and
        gives back what they held (``_recover``); one whose state cannot be made consistent again stops the engine
        (``_stop``): every request fails, and the worker exits so that a fresh one takes its place."""
        try:
            while self.fatal is None:
                try:
                    self._iteration()
                    self._check_idle()
                except Exception as exc:
                    self._recover(exc)
                self._flush()
                self.last_progress = time.monotonic()
        except BaseException as exc:  # recovery failed, or the thread is being torn down
            log.error("the engine could not recover: %s: %s", type(exc).__name__, exc, exc_info=exc)
            self._stop("the engine could not recover from a failed step")

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until the loop waits for work with no request in the engine (every iteration's bookkeeping done);
        False when ``timeout`` passed first. For tests and tools that inspect the engine's state between requests."""
        with self._cond:
            return self._quiet.wait_for(
                lambda: (self._waiting_for_work and not self._requests) or self.fatal is not None, timeout
            )

    def stalled_s(self) -> float:
        """Seconds the loop has not come round while requests are in the engine (0 when none are): the liveness
        probe's number (``/livez``)."""
        if self.fatal is not None:
            return float("inf")
        with self._cond:
            busy = bool(self._requests)
        return max(0.0, time.monotonic() - self.last_progress) if busy else 0.0

    def _recover(self, exc: BaseException) -> None:
        """An iteration failed part way (a forward, the sampler, a prompt joining, a preemption, ...): every group
        it touched (those not waiting in the queue) fails with ``EngineStepFailed``, the batch gives back every
        row, reserved prompt and block (``BlockBatch.reset``; the prefix cache with them), parked rows whose group
        is gone leave, and the draft's pool lets go of everything. Waiting requests, preempted ones included (their
        rows are computed again when they come back), are served on. Raises when the state is still inconsistent
        after that (``_run`` then stops the engine)."""
        detail = "a step of the engine failed"  # the answer's words; the error and its traceback are in the log
        _drop_frames(exc)
        error = exc if isinstance(exc, torch.OutOfMemoryError) else EngineStepFailed(detail)
        with self._cond:
            waiting = {id(g) for g in self._pending}
            touched = [g for groups in self._requests.values() for g in groups if id(g) not in waiting]
        self._prefilling.clear()
        self.batch.reset(free_memory=isinstance(exc, torch.OutOfMemoryError))
        if self.batch.speculation is not None:
            self.batch.speculation.release_all()
        for group in touched:
            self._end(group, error)
        parked = {g.arrival for g in self._pending}
        for arrival in [a for a in self.batch.parked if a not in parked]:
            del self.batch.parked[arrival]
        self._after_failure(exc)
        problem = self.inconsistency()
        if problem is not None:
            raise RuntimeError(problem)
        log.warning("%s: %d requests failed, %d wait and are served on", detail, len(touched), len(self._pending))

    def inconsistency(self) -> str | None:
        """What is wrong with the engine's state between iterations, in words (None: nothing): every request's
        groups are waiting, prefilling or running; blocks are held by rows and prompts only; parked rows belong to
        waiting groups; every request holding a slot is in the engine."""
        batch = self.batch
        with self._cond:
            owned = {id(g) for groups in self._requests.values() for g in groups}
            pending = {id(g) for g in self._pending}
            requests = set(self._requests)
            running_ids = set(self.admission._running)
        placed = pending | {id(g) for g in batch.groups} | {id(job.group) for job in self._prefilling}
        if owned != placed:
            return f"{len(owned - placed)} groups are nowhere, {len(placed - owned)} are placed but not owned"
        if not batch.groups and not self._prefilling and (batch.n or batch.prompts or batch.blocks.held_blocks):
            return f"nothing runs but {batch.n} rows, {batch.prompts} prompts, {batch.blocks.held_blocks} blocks remain"
        if batch.n != sum(g.rows for g in batch.groups):
            return f"the batch has {batch.n} rows, its groups {sum(g.rows for g in batch.groups)}"
        if set(batch.parked) - {g.arrival for g in self._pending}:
            return "rows are parked for groups that do not wait"
        if not running_ids <= requests:
            return "slots are held by requests the engine does not have"
        if not requests and batch.speculation is not None and batch.speculation.proposer.held_blocks():
            return f"the draft holds {batch.speculation.proposer.held_blocks()} blocks with no request in the engine"
        return None

    def _check_idle(self) -> None:
        """After an iteration with nothing running or prefilling: nothing may be held. Blocks still held then are a
        leak (a path that forgot to give them back): they are taken back (the pool is reset; ``repairs`` counts it)
        so that the leak cannot grow into a wedge, and logged as the defect it is."""
        batch = self.batch
        if batch.groups or self._prefilling or not (batch.blocks.held_blocks or batch.prompts or batch.n):
            return
        self.repairs += 1
        log.error(
            "engine state repaired: %d blocks, %d prompts, %d rows held with nothing running",
            batch.blocks.held_blocks,
            batch.prompts,
            batch.n,
        )
        batch.reset(free_memory=False)

    def _stop(self, reason: str) -> None:
        """The engine cannot go on: every request in it fails with ``reason``, none is taken any more, and
        ``on_fatal`` is told (the worker exits so that a fresh one takes its place)."""
        log.critical("saker: %s; failing every request and stopping the engine", reason)
        error = EngineStepFailed(reason, fatal=True)
        with self._cond:
            self.fatal = reason
            groups = [g for groups in self._requests.values() for g in groups]
            self._pending.clear()
        # those a failed recovery already failed (not sent yet) hear that the engine stops, not that it serves on
        self._outputs = [
            (rid, tag, error if isinstance(payload, EngineStepFailed) else payload)
            for rid, tag, payload in self._outputs
        ]
        for group in groups:
            try:
                self._end(group, error)
            except Exception:  # the end of one must not keep the others from hearing
                log.exception("could not end a request's group")
        self._flush()
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def _take_admissible(self) -> list[RequestGroup]:
        with self._cond:
            while True:
                if self._pending:
                    self._leave_queue()
                if self.batch.groups or self._prefilling:
                    break
                if self._pending and self.admission.holds(self._pending[0].request_id):
                    break
                if self._outputs:  # requests that left the queue hear of it before the loop waits
                    return []
                deadline = self.admission.next_deadline()  # nothing to run: wait for a request, or a timeout
                self._waiting_for_work = True
                self._quiet.notify_all()
                self._cond.wait(None if deadline is None else max(0.0, deadline - time.perf_counter()))
                self._waiting_for_work = False
            taken: list[RequestGroup] = []
            if not self._pending:  # the common case while decoding: nothing to weigh
                return taken
            coming = [job.group for job in self._prefilling]  # admitted, still prefilling in chunks
            # a group with more candidates than max_batch_rows runs alone at first, then others fill up to
            # max_batch_rows rows beside it (its rows do not count against that limit, only against the KV
            # budget): small requests do not wait for a large one to end
            rows = sum(self._counted(g) for g in self.batch.groups + coming)
            adapters = self.batch.adapters | {g.params.adapter for g in coming}
            busy = bool(self.batch.groups or coming)
            blocks = self.batch.free_blocks() - self.batch.rows  # running rows grow into free blocks
            while self._pending:
                group = self._pending[0]
                if not self.admission.holds(group.request_id):
                    break  # it waits for a running slot (max_running_requests)
                if busy:
                    if rows + group.params.num_candidates > self.max_batch_rows:
                        break
                    if group.blocks_now > blocks:  # the blocks it takes now
                        break
                    if not self.runner.can_join(adapters, group.params.adapter):
                        break
                self._pending.popleft()
                taken.append(group)
                busy = True
                adapters.add(group.params.adapter)
                rows += self._counted(group)
                blocks -= group.blocks_now
            return taken

    def _leave_queue(self) -> None:
        """Waiting groups whose request was cancelled, and requests that waited past the queue timeout (they fail
        with ``QueueTimeout``), leave the queue."""
        failed = dict(self.admission.expired(time.perf_counter()))
        leaving = [g for g in self._pending if g.cancelled or g.request_id in failed]
        for group in leaving:
            self._pending.remove(group)
            self._end(group, failed.get(group.request_id))

    def _counted(self, group: RequestGroup) -> int:
        """A group's rows as max_batch_rows counts them: none for a group larger than the limit by itself."""
        rows = group.params.num_candidates
        return 0 if rows > self.max_batch_rows else rows

    def _make_room(self) -> list[RequestGroup]:
        """Before a step: when the blocks its rows cross into are more than the pool has free, the newest request
        (the last to arrive) among those running and those being prefilled gives its blocks back and waits at the
        head of the queue: its rows are computed again when it comes back (``ChunkedPrefill``), and go on as if
        they had never left. Older requests never wait for newer ones, and no request fails for want of blocks.
        Returns the groups preempted."""
        batch = self.batch
        preempted: list[RequestGroup] = []
        while batch.groups and batch.blocks_wanted() > batch.free_blocks():
            candidates = [(g.arrival, 0, g) for g in batch.groups]
            candidates += [(job.group.arrival, 1, job) for job in self._prefilling]
            if len(candidates) < 2:
                break  # one request alone always fits (the 400 check counts its blocks)
            _, prefilling, newest = max(candidates, key=lambda c: c[0])
            if prefilling:
                self._prefilling.remove(newest)
                newest.abandon(batch)
                group = newest.group
                group.status = Status.WAITING
            else:
                group = newest
                preempt(batch, group)
            self.preemptions += 1
            preempted.append(group)
            with self._cond:
                self._pending.appendleft(group)
            log.info("KV blocks ran out: the newest request waits with its blocks given back (%d)", self.preemptions)
        return preempted

    @property
    def speculation_counts(self) -> dict | None:
        """Speculative decoding's counters (``speculative.Speculation``), None when it is off."""
        return self.batch.speculation.counts() if self.batch.speculation is not None else None

    @property
    def kv_usage(self) -> float:
        """The KV blocks held by the running rows and the prompts being prefilled, as a share of the pool (0-1)."""
        return self.batch.kv_usage

    def _iteration(self) -> None:
        """One step: schedule (admit waiting requests, their prompts start prefilling; drop rows that ended; plan
        the prompt chunks within the step's token budget), execute (one forward in which every running row advances by
        a token and the prompts being prefilled by a chunk each), postprocess (the rows' numbers out, prompts that
        are in join the batch)."""
        taken = self._take_admissible()
        with torch.inference_mode():
            plan = self._schedule(taken)
            results = self._execute(plan)
            if results is not None:
                self._postprocess(plan, *results)

    def _schedule(self, taken: list[RequestGroup]) -> SchedulerOutput:
        for group in taken:
            self._register(group)
            if group.prefills:
                self._start_prefill(group)
            else:  # it needs no forward (it generates nothing and scores no prompt): its prompt's numbers
                self._emit(group, [group.prompt_numbers()])
                self._end(group)
        for group in [g for g in self.batch.groups if g.cancelled]:
            drop(self.batch, group)
            self._end(group)
        running = list(self.batch.groups)
        if drop_finished(self.batch):  # candidates the output side ended (stop strings)
            for group in running:
                if group.status is Status.FINISHED:
                    self._end(group)
        preempted = self._make_room()
        chunks, apart = self._plan()
        return SchedulerOutput(list(self.batch.groups), chunks, apart, preempted)

    def _execute(self, plan: SchedulerOutput) -> tuple[list[tuple[RequestGroup, list[Event]]], float] | None:
        """The plan's forwards: the chunks apart first (prompts that are in join the batch), then the step of every
        row with the riding chunks. Returns each group's events and the step's seconds (None: no row ran). Rows that
        joined just now and cross into more blocks than are free wait for the next schedule to make room."""
        for alone in plan.apart:  # nothing runs, or the rows use another adapter
            self._chunks_alone(alone)
        if not self.batch.groups:
            return None
        if plan.apart and self.batch.blocks_wanted() > self.batch.free_blocks():
            return None
        start = time.perf_counter()
        results = self._decode_step(plan.chunks)  # a failure fails what the step touched (``_recover``)
        return results, time.perf_counter() - start

    def _postprocess(self, plan: SchedulerOutput, results: list[tuple[RequestGroup, list[Event]]], took: float):
        self.steps += 1
        self.max_rows_seen = max(self.max_rows_seen, sum(len(events) for _, events in results))
        for group, events in results:
            group.timings.decode_s += took
            self._emit(group, events)
            if not group.rows:
                self._end(group)
        for job, _ in plan.chunks:
            if job.remaining == 0 and job in self._prefilling:
                self._finish_prefill(job)

    def _register(self, group: RequestGroup) -> None:
        if not group.preempted:
            group.timings.queue_s = time.perf_counter() - group.submitted

    def _start_prefill(self, group: RequestGroup) -> None:
        """A prompt to prefill: its blocks reserved, its chunks computed by the coming steps."""
        job = ChunkedPrefill(group, self.prefill_chunk_tokens or len(group.prompt_ids))
        try:
            with self.runner.adapter(group.params.adapter):
                job.start(self.batch)
        except BaseException as exc:
            job.abandon(self.batch)
            _drop_frames(exc)
            self._after_failure(exc)
            self._end(group, exc)
            return
        self._prefilling.append(job)

    def _plan(self) -> tuple[list[tuple[ChunkedPrefill, list[int]]], list[list[tuple[ChunkedPrefill, list[int]]]]]:
        """This step's prompt chunks: the prompts being prefilled, oldest first, within the step's token budget (the
        running rows' decode tokens count first), each at most a chunk (a step with a chunk is a decoding stream's
        inter-token gap). Those that use the running rows' adapter ride in the decode step's forward; the others
        are computed before it, one forward per adapter (one forward runs one adapter). Prompts whose clients went
        away leave first (their slots are free now)."""
        for job in [job for job in self._prefilling if job.group.cancelled]:
            self._prefilling.remove(job)
            job.abandon(self.batch)
            self._end(job.group)
        if not self._prefilling:
            return [], []
        by_adapter: dict[object, list[tuple[ChunkedPrefill, list[int]]]] = {}
        one = self.prefill_tokens <= 0  # one prompt's chunk per step
        budget = self._prefilling[0].chunk if one else self.prefill_tokens - self.batch.rows
        for job in self._prefilling:
            if by_adapter and (one or budget <= 0):
                break
            chunk = job.next_chunk(max(1, budget))  # the oldest prompt moves on even when the rows fill the budget
            by_adapter.setdefault(job.group.params.adapter, []).append((job, chunk))
            budget -= len(chunk)
        riding = []
        if self.batch.groups and (not self.runner.adapters or self.batch.adapter is not MIXED):
            riding = by_adapter.pop(self.batch.adapter, [])
        return riding, list(by_adapter.values())

    def _chunks_alone(self, jobs: list[tuple[ChunkedPrefill, list[int]]]) -> None:
        """Prompt chunks in a forward of their own; prompts that are in join the batch."""
        try:
            with self.runner.adapter(jobs[0][0].group.params.adapter):
                compute_chunks(self.batch, jobs, with_rows=False)
        except BaseException as exc:
            if len(jobs) == 1:
                self._fail_prefill(jobs[0][0], exc)
                return
            log.warning(
                "prefill of %d prompts together failed (%s: %s); one at a time",
                len(jobs),
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
            )
            _drop_frames(exc)
            self._after_failure(exc)
            for job in jobs:
                self._chunks_alone([job])
            return
        for job, _ in jobs:
            if job.remaining == 0:
                self._finish_prefill(job)

    def _finish_prefill(self, job: ChunkedPrefill) -> None:
        group = job.group
        self._prefilling.remove(job)
        try:
            with self.runner.adapter(group.params.adapter):
                events = job.finish(self.batch)
        except torch.OutOfMemoryError as exc:  # its first tokens' sampling: it fails alone
            self._fail_prefill(job, exc, removed=True)
            return  # (any other failure is the iteration's: ``_recover``)
        self._emit(group, events)
        if group.status is not Status.RUNNING:
            self._end(group)

    def _fail_prefill(self, job: ChunkedPrefill, exc: BaseException, removed: bool = False) -> None:
        if not removed and job in self._prefilling:
            self._prefilling.remove(job)
        job.abandon(self.batch)
        _drop_frames(exc)
        self._after_failure(exc)
        self._end(job.group, exc)

    def _decode_step(self, jobs: list[tuple[ChunkedPrefill, list[int]]]) -> list[tuple[RequestGroup, list[Event]]]:
        """One decode step (carrying ``jobs``' chunks). When the forward runs out of memory, the newest prompt
        being prefilled fails first, then the newest group (its request gets the out-of-memory error), and the
        step is retried for the others."""
        while True:
            try:
                with self.runner.adapter(self.batch.adapter):
                    return decode_step(self.batch, jobs)
            except BatchOutOfMemory as oom:
                if jobs:
                    error = oom.error
                    del oom
                    self._fail_prefill(jobs.pop()[0], error)
                    continue
                newest = self.batch.groups[-1]
                drop(self.batch, newest)
                error = oom.error
                _drop_frames(error)  # the failed forward's activations
                del oom
                self._after_failure(error)
                self._end(newest, error)
                log.warning(
                    "out of memory in a step of %d groups: the newest request failed, %d go on",
                    len(self.batch.groups) + 1,
                    len(self.batch.groups),
                )

    def _after_failure(self, exc: BaseException) -> None:
        self.failures += 1
        if isinstance(exc, torch.OutOfMemoryError):
            from app.engine.model.oom import free_memory

            self.batch.blocks.clear_cached()  # kept prompts are the first memory to give back
            free_memory()


def _drop_frames(exc: BaseException) -> None:
    """Let go of what a failed forward's frames hold (activations, a KV cache) before memory is freed. A failure
    other than running out of memory is logged first with its traceback on this thread (the request that hears of
    it gets the exception without these frames)."""
    if not isinstance(exc, torch.OutOfMemoryError):
        log.error("engine step failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
    traceback.clear_frames(exc.__traceback__)
    exc.__traceback__ = None
