"""The engine core (vLLM v1's ``EngineCore``): one thread that owns the model's batch and steps it.

It is the in-process engine (``client.Engine``): requests come with ``add_request`` and leave with ``abort``; each
iteration's outputs, keyed by request id, go out once it ends (``deliver``: to the requests' tickets in process,
over the pipe in the engine process, which serves this same class).

``step()`` is schedule -> execute -> postprocess: the ``Scheduler`` (policy only) says what the step computes
(``SchedulerOutput``), one forward computes it for every row and every riding prompt chunk (chunks of other
adapters apart before it), and postprocessing hands out the rows' numbers and joins the prompts that are in. A step
whose forward runs out of memory fails the newest group only and is retried for the others.

Fault isolation: an iteration that fails fails the requests it touched and gives back what they held
(``_recover``); one whose state cannot be made consistent again stops the engine (``_stop``): every request
fails, and the worker exits so that a fresh one takes its place.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback

import torch

from app.engine.core.batches import BatchOutOfMemory, BlockBatch
from app.engine.core.client import Ended, Engine
from app.engine.core.prefill import ChunkedPrefill
from app.engine.core.scheduler import Chunk, Scheduler, SchedulerOutput
from app.engine.core.sequence import RequestGroup, Status
from app.engine.core.speculative import SpeculativeConfig
from app.engine.core.step import Event, compute_chunks, decode_step, drop, propose
from app.engine.errors import EngineError, EngineNotReady, EngineStepFailed
from app.engine.model.runner import ModelRunner

log = logging.getLogger("saker.scheduler")  # the engine's log lines, as operators know them


class EngineCore(Engine):
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
        self.batch = BlockBatch(runner, kv_cache_tokens, prefix_cache_tokens)
        self.batch.speculation = speculative.build(runner) if speculative is not None else None
        self.scheduler = Scheduler(
            runner,
            self.batch,
            max_batch_rows=max_batch_rows,
            prefill_tokens=prefill_tokens,
            prefill_chunk_tokens=prefill_chunk_tokens,
            max_running_requests=max_running_requests,
            max_queue=max_queue,
            queue_timeout=queue_timeout,
        )
        self.scheduler.on_end = self._report
        self._outputs: list[tuple[int, int, object]] = []  # this iteration's (rid, tag, payload), sent at its end
        self._held: dict[int, list[tuple[int, int, object]]] = {}  # a lazy request's outputs, until a prompt ends
        self.deliver = self.route  # where an iteration's outputs go (the engine process sends them on its pipe)
        self._cond = threading.Condition(self.scheduler.lock)  # the loop waits on it for work
        self._quiet = threading.Condition(self.scheduler.lock)  # ``wait_idle`` waits on it for the loop to wait
        self._waiting_for_work = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.max_rows_seen = 0  # the largest batch a step has served (stats and tests)
        # fault isolation: steps that failed (their requests failed, everything they held given back), leaks found
        # and repaired at an idle point, and why the engine stopped when it could not be made consistent again
        self.failures = 0
        self.repairs = 0
        self.fatal: str | None = None
        self.on_fatal = None  # called with ``fatal`` once every request heard of it (the worker exits)
        self.last_progress = time.monotonic()  # when the loop last came round (the liveness probe's clock)
        # set by ``startup.start_engine``: the model's facts, the KV budget in use, the load's seconds
        self.info = None
        self.kv_cache_tokens = kv_cache_tokens
        self.load_seconds = 0.0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="saker-scheduler", daemon=True)
        self._thread.start()

    # -- the engine interface (``client.Engine``) ---------------------------------------------------------------
    def add_request(self, rid: int, groups: list[RequestGroup], eager: bool = True) -> None:
        """Queue the groups (prompts) of request ``rid``. ``eager``: its outputs go out every iteration (a stream,
        stop strings), otherwise when one of its prompts ends."""
        for group in groups:
            group.make_grammars(self.runner)  # on the submitting thread, not the model thread
        with self._cond:
            if self.fatal is not None:
                raise EngineNotReady(self.fatal)
            idle = not self.scheduler.requests
            self.scheduler.add(rid, groups, eager, time.perf_counter())  # QueueFull: nothing was queued
            if idle:  # the loop was idle: the liveness clock starts now, not when it last ran
                self.last_progress = time.monotonic()
            self._cond.notify()

    def abort(self, rid: int) -> None:
        """The request's client went away: its groups leave at the next step (waiting ones when their turn comes)."""
        with self._cond:
            self.scheduler.abort(rid)
            self._cond.notify()  # a request waiting for its slot leaves at once

    def finish(self, rid: int, tag: int, index: int) -> None:
        """A stop string ended candidate ``index`` of prompt ``tag``: its row leaves at the next step."""
        self.scheduler.finish(rid, tag, index)

    def queue_snapshot(self) -> dict[str, int]:
        """The waiting queue's counts: requests running (holding a slot), waiting for one, rejected, timed out."""
        with self._cond:
            return self.scheduler.admission.snapshot()

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions

    @property
    def speculation_counts(self) -> dict | None:
        """Speculative decoding's counters (``speculative.Speculation``), None when it is off."""
        return self.batch.speculation.counts() if self.batch.speculation is not None else None

    @property
    def kv_usage(self) -> float:
        """The KV blocks held by the running rows and the prompts being prefilled, as a share of the pool (0-1)."""
        return self.batch.kv_usage

    # -- outputs ------------------------------------------------------------------------------------------------
    def _emit(self, group: RequestGroup, events: list) -> None:
        """A group's events of this iteration (numbers), for its request's reader."""
        if events:
            item = (group.request_id, group.tag, events)
            if group.eager:
                self._outputs.append(item)
            else:
                self._held.setdefault(group.request_id, []).append(item)

    def _end(self, group: RequestGroup, error: BaseException | None = None) -> None:
        """The group is done (every row ended, it was cancelled, or it failed with ``error``): the scheduler lets
        it go and ``_report`` sends its end."""
        self.scheduler.end(group, error)

    def _report(self, group: RequestGroup, error: BaseException | None) -> None:
        """A group left the scheduler: its request's held outputs and its end go out with this iteration."""
        if error is not None and not isinstance(error, (EngineError, torch.OutOfMemoryError)):
            error = EngineStepFailed("the engine failed on this request")  # what failed is in the log, not the answer
        rid = group.request_id
        self._outputs += self._held.pop(rid, [])
        self._outputs.append((rid, group.tag, Ended.of(group) if error is None else error))

    def _flush(self) -> None:
        if self._outputs:
            outputs, self._outputs = self._outputs, []
            self.deliver(outputs)

    # -- the loop -------------------------------------------------------------------------------------------
    def _run(self) -> None:
        """Iterations until the engine cannot go on (see the module's docstring)."""
        try:
            while self.fatal is None:
                try:
                    if self._wait_for_work():
                        with torch.inference_mode():
                            self.step()
                    self._check_idle()
                except Exception as exc:
                    self._recover(exc)
                self._flush()
                self.last_progress = time.monotonic()
        except BaseException as exc:  # recovery failed, or the thread is being torn down
            log.error("the engine could not recover: %s: %s", type(exc).__name__, exc, exc_info=exc)
            self._stop("the engine could not recover from a failed step")

    def _wait_for_work(self) -> bool:
        """Until a step has something to do (True), or requests that left the queue have outputs to hear (False)."""
        scheduler = self.scheduler
        with self._cond:
            while True:
                scheduler.leave_queue()
                if scheduler.has_work():
                    return True
                if self._outputs:  # requests that left the queue hear of it before the loop waits
                    return False
                deadline = scheduler.admission.next_deadline()  # nothing to run: wait for a request, or a timeout
                self._waiting_for_work = True
                self._quiet.notify_all()
                self._cond.wait(None if deadline is None else max(0.0, deadline - time.perf_counter()))
                self._waiting_for_work = False

    def step(self) -> None:
        """One step: what the scheduler planned, computed, and its numbers handed out."""
        plan = self.scheduler.schedule()
        results = self._execute(plan)
        self._postprocess(plan, results)

    def _execute(self, plan: SchedulerOutput) -> tuple[list[tuple[RequestGroup, list[Event]]], float] | None:
        """The plan's forwards: the chunks apart first (prompts that are in join the batch), then the step of every
        row with the riding chunks. Returns each group's events and the step's seconds (None: no row ran). Rows that
        joined just now and cross into more blocks than are free wait for the next schedule to make room."""
        for group in plan.scored:
            self._emit(group, [group.prompt_numbers()])
            self._end(group)
        for group, exc in plan.failed:
            _drop_frames(exc)
            self._after_failure(exc)
            self._end(group, exc)
        for alone in plan.apart:  # nothing runs, or the rows use another adapter
            self._chunks_alone(alone)
        if not self.batch.groups:
            return None
        if plan.apart and self.batch.blocks_wanted() > self.batch.free_blocks():
            return None
        if plan.apart:  # rows may have joined: the guesses are for the batch as it is now
            plan.guesses = propose(self.batch)
        start = time.perf_counter()
        results = self._decode_step(plan.chunks, plan.guesses)  # a failure fails what the step touched (``_recover``)
        return results, time.perf_counter() - start

    def _postprocess(self, plan: SchedulerOutput, ran) -> None:
        if ran is None:
            return
        results, took = ran
        self.steps += 1
        self.max_rows_seen = max(self.max_rows_seen, sum(len(events) for _, events in results))
        for group, events in results:
            group.timings.decode_s += took
            self._emit(group, events)
            if not group.rows:
                self._end(group)
        for job, _ in plan.chunks:
            if job.remaining == 0 and job in self.scheduler.prefilling:
                self._finish_prefill(job)

    def _chunks_alone(self, jobs: list[Chunk]) -> None:
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
        self.scheduler.prefilling.remove(job)
        if group.cancelled:  # its client left while its prompt was computed: it does not join (nor decode)
            job.abandon(self.batch)
            self._end(group)
            return
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
        if not removed and job in self.scheduler.prefilling:
            self.scheduler.prefilling.remove(job)
        job.abandon(self.batch)
        _drop_frames(exc)
        self._after_failure(exc)
        self._end(job.group, exc)

    def _decode_step(
        self, jobs: list[Chunk], guesses: list[list[int]] | None
    ) -> list[tuple[RequestGroup, list[Event]]]:
        """One decode step (carrying ``jobs``' chunks and the rows' ``guesses``). When the forward runs out of
        memory, the newest prompt being prefilled fails first, then the newest group (its request gets the
        out-of-memory error), and the step is retried for the others (their guesses proposed again)."""
        retry = False
        while True:
            try:
                with self.runner.adapter(self.batch.adapter):
                    return decode_step(self.batch, jobs, propose(self.batch) if retry else guesses)
            except BatchOutOfMemory as oom:
                retry = True
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

    # -- fault isolation ----------------------------------------------------------------------------------------
    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until the loop waits for work with no request in the engine (every iteration's bookkeeping done);
        False when ``timeout`` passed first. For tests and tools that inspect the engine's state between requests."""
        with self._cond:
            return self._quiet.wait_for(
                lambda: (self._waiting_for_work and not self.scheduler.requests) or self.fatal is not None, timeout
            )

    def stalled_s(self) -> float:
        """Seconds the loop has not come round while requests are in the engine (0 when none are): the liveness
        probe's number (``/livez``)."""
        if self.fatal is not None:
            return float("inf")
        with self._cond:
            busy = bool(self.scheduler.requests)
        return max(0.0, time.monotonic() - self.last_progress) if busy else 0.0

    def inconsistency(self) -> str | None:
        """What is wrong with the engine's state between iterations (``Scheduler.inconsistency``)."""
        return self.scheduler.inconsistency()

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
        touched = self.scheduler.admitted()
        self.scheduler.prefilling.clear()
        self.batch.reset(free_memory=isinstance(exc, torch.OutOfMemoryError))
        if self.batch.speculation is not None:
            self.batch.speculation.release_all()
        for group in touched:
            self._end(group, error)
        self.scheduler.forget_running()
        self._after_failure(exc)
        problem = self.inconsistency()
        if problem is not None:
            raise RuntimeError(problem)
        log.warning(
            "%s: %d requests failed, %d wait and are served on", detail, len(touched), len(self.scheduler.waiting)
        )

    def _check_idle(self) -> None:
        """After an iteration with nothing running or prefilling: nothing may be held. Blocks still held then are a
        leak (a path that forgot to give them back): they are taken back (the pool is reset; ``repairs`` counts it)
        so that the leak cannot grow into a wedge, and logged as the defect it is."""
        batch = self.batch
        if batch.groups or self.scheduler.prefilling or not (batch.blocks.held_blocks or batch.prompts or batch.n):
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
            groups = self.scheduler.take_all()
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
