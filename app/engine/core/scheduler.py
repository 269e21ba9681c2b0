"""The scheduler: policy only (nano-vllm's and vLLM v1's ``Scheduler``). It owns no thread and runs no forward;
``engine_core.EngineCore`` calls ``schedule()`` once per step and executes what it returns.

Requests arrive as groups (one per prompt) and wait in one queue, in order of arrival: at most
``max_running_requests`` requests hold a running slot, at most ``max_queue`` wait for one, none longer than the
queue timeout (the rules are ``admission.Admission``'s). Each step the scheduler admits the queue's front groups,
those whose request holds a slot, while the batch has room (``max_batch_rows`` rows, the KV blocks a group takes
now; named LoRA adapters mix in one batch, other adapter types need the same one): their prompts start prefilling
(``ChunkedPrefill``: blocks reserved, computed chunk by chunk in the coming steps). It drops rows that ended
(cancelled, or ended by a stop string), makes room when the rows outgrow the KV pool (the newest request gives its
blocks back and is computed again later: ``_make_room``), and plans the step's prompt chunks within its token
budget. What it decided is a ``SchedulerOutput``.

A group leaves the scheduler through ``end`` (its slot, its parked rows and draft blocks given back); ``on_end``
(the engine core) hears of it at once, to send the request its end.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from app.engine.core.admission import Admission
from app.engine.core.batches import BlockBatch
from app.engine.core.prefill import ChunkedPrefill
from app.engine.core.sequence import RequestGroup, Status
from app.engine.core.step import drop, drop_finished, preempt, propose
from app.engine.model.runner import MIXED, ModelRunner

log = logging.getLogger("saker.scheduler")

Chunk = tuple[ChunkedPrefill, list[int]]  # a prompt being prefilled and its next tokens


@dataclass
class SchedulerOutput:
    """What one step computes (``Scheduler.schedule``):

    - ``rows``: the groups whose rows decode (each row its next token, and its guesses with speculation);
    - ``chunks``: the prompt chunks that ride in the same forward, each job with its next tokens;
    - ``apart``: chunks computed before it, one forward per PEFT adapter (nothing runs, or the rows use another);
    - ``scored``: admitted groups that need no forward (they generate nothing and score no prompt);
    - ``failed``: admitted groups whose prefill could not start, with the error;
    - ``preempted``: groups preempted to make room for the step (their blocks given back, their rows parked);
    - ``guesses``: with speculative decoding, each row's guessed tokens (row order, fitted to the free blocks;
      ``step.propose``), which the step's forward checks; None when the step carries none, or when chunks computed
      apart will add rows to the batch first (the core proposes after they join)."""

    rows: list[RequestGroup] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    apart: list[list[Chunk]] = field(default_factory=list)
    scored: list[RequestGroup] = field(default_factory=list)
    failed: list[tuple[RequestGroup, BaseException]] = field(default_factory=list)
    preempted: list[RequestGroup] = field(default_factory=list)
    guesses: list[list[int]] | None = None


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        batch: BlockBatch,
        *,
        max_batch_rows: int = 8,
        prefill_tokens: int = 0,
        prefill_chunk_tokens: int = 0,
        max_running_requests: int | None = None,
        max_queue: int | None = None,
        queue_timeout: float | None = None,
    ):
        self.runner, self.batch = runner, batch
        self.max_batch_rows = max(1, max_batch_rows)
        # prompt tokens one step computes, across the prompts being prefilled (the running rows' tokens count too)
        self.prefill_tokens = prefill_tokens
        # a prompt computes at most this many of its tokens per step (0: the whole prompt, budget allowing)
        self.prefill_chunk_tokens = prefill_chunk_tokens
        # the one waiting queue: every request's prompts in order of arrival (preempted ones back at its head); the
        # requests holding a running slot (``admission``: at most max_running_requests) are always its front
        self.waiting: collections.deque[RequestGroup] = collections.deque()
        self.prefilling: collections.deque[ChunkedPrefill] = collections.deque()  # admitted, computed in chunks
        self.admission = Admission(max_queue, queue_timeout, capacity=max_running_requests or self.max_batch_rows)
        self.requests: dict[int, list[RequestGroup]] = {}  # by request id: its groups not ended yet
        # the queue and the requests are shared with the threads that add and abort requests
        self.lock = threading.RLock()
        self.on_end: Callable[[RequestGroup, BaseException | None], None] = lambda group, error: None
        self._arrivals = 0  # groups submitted so far: each group's ``arrival`` (the newest is preempted first)
        self.preemptions = 0  # groups whose rows left the batch for older requests' blocks (``_make_room``)

    # -- requests in and out (any thread) -----------------------------------------------------------------------
    def add(self, rid: int, groups: list[RequestGroup], eager: bool, now: float) -> None:
        """Queue request ``rid``'s groups (``QueueFull``: nothing was queued)."""
        with self.lock:
            self.admission.arrive(rid, now)
            self.requests[rid] = list(groups)
            for group in groups:
                group.request_id, group.eager, group.submitted = rid, eager, now
                self._arrivals += 1
                group.arrival = self._arrivals
                self.waiting.append(group)

    def abort(self, rid: int) -> None:
        """The request's client went away: its groups leave at the next step (waiting ones when their turn comes)."""
        with self.lock:
            for group in self.requests.get(rid, ()):
                group.cancelled = True

    def finish(self, rid: int, tag: int, index: int) -> None:
        """A stop string ended candidate ``index`` of prompt ``tag``: its row leaves at the next step."""
        with self.lock:
            for group in self.requests.get(rid, ()):
                if group.tag == tag:
                    group.finish_candidate(index)

    def end(self, group: RequestGroup, error: BaseException | None = None) -> None:
        """The group is no longer the scheduler's (every row ended, it was cancelled, or it failed with ``error``):
        its parked rows and its draft's blocks are given back, and when it was its request's last group the
        request's slot goes to the longest waiter. ``on_end`` hears of it."""
        group.status = Status.FINISHED
        self.batch.unpark(group)  # a preempted group that ends before it came back
        if self.batch.speculation is not None:
            self.batch.speculation.forget(group.seqs)  # a draft's blocks for its sequences
        with self.lock:
            rid = group.request_id
            left = [g for g in self.requests.get(rid, ()) if g is not group]
            if left:
                self.requests[rid] = left
            elif self.requests.pop(rid, None) is not None:
                self.admission.leave(rid, time.perf_counter())
        self.on_end(group, error)

    # -- between steps (the engine core's thread) ---------------------------------------------------------------
    def leave_queue(self) -> None:
        """Waiting groups whose request was cancelled, and requests that waited past the queue timeout (they fail
        with ``QueueTimeout``), leave the queue."""
        with self.lock:
            if not self.waiting:
                return
            failed = dict(self.admission.expired(time.perf_counter()))
            leaving = [g for g in self.waiting if g.cancelled or g.request_id in failed]
            for group in leaving:
                self.waiting.remove(group)
                self.end(group, failed.get(group.request_id))

    def has_work(self) -> bool:
        """Whether a step would do something: rows run, prompts prefill, or the queue's front may be admitted."""
        with self.lock:
            if self.batch.groups or self.prefilling:
                return True
            return bool(self.waiting) and self.admission.holds(self.waiting[0].request_id)

    def schedule(self) -> SchedulerOutput:
        """This step: admit what fits (prompts start prefilling), drop rows that ended, make room in the KV pool,
        plan the prompt chunks and the rows' guesses."""
        plan = SchedulerOutput()
        for group in self._admit():
            if not group.preempted:
                group.timings.queue_s = time.perf_counter() - group.submitted
            if group.prefills:
                self._start_prefill(group, plan)
            else:  # it needs no forward: its prompt's numbers only
                plan.scored.append(group)
        for group in [g for g in self.batch.groups if g.cancelled]:
            drop(self.batch, group)
            self.end(group)
        running = list(self.batch.groups)
        if drop_finished(self.batch):  # candidates the output side ended (stop strings)
            for group in running:
                if group.status is Status.FINISHED:
                    self.end(group)
        plan.preempted = self._make_room()
        plan.chunks, plan.apart = self._plan()
        plan.rows = list(self.batch.groups)
        if not plan.apart:
            plan.guesses = propose(self.batch)
        return plan

    def _admit(self) -> list[RequestGroup]:
        """The queue's front groups that fit beside what runs (rows, blocks, adapters), in order."""
        taken: list[RequestGroup] = []
        with self.lock:
            if not self.waiting:  # the common case while decoding: nothing to weigh
                return taken
            coming = [job.group for job in self.prefilling]  # admitted, still prefilling in chunks
            # a group with more candidates than max_batch_rows runs alone at first, then others fill up to
            # max_batch_rows rows beside it (its rows do not count against that limit, only against the KV
            # budget): small requests do not wait for a large one to end
            rows = sum(self._counted(g) for g in self.batch.groups + coming)
            adapters = self.batch.adapters | {g.params.adapter for g in coming}
            busy = bool(self.batch.groups or coming)
            blocks = self.batch.free_blocks() - self.batch.rows  # running rows grow into free blocks
            while self.waiting:
                group = self.waiting[0]
                if not self.admission.holds(group.request_id):
                    break  # it waits for a running slot (max_running_requests)
                if busy:
                    if rows + group.params.num_candidates > self.max_batch_rows:
                        break
                    if group.blocks_now > blocks:  # the blocks it takes now
                        break
                    if not self.runner.can_join(adapters, group.params.adapter):
                        break
                self.waiting.popleft()
                taken.append(group)
                busy = True
                adapters.add(group.params.adapter)
                rows += self._counted(group)
                blocks -= group.blocks_now
        return taken

    def _counted(self, group: RequestGroup) -> int:
        """A group's rows as max_batch_rows counts them: none for a group larger than the limit by itself."""
        rows = group.params.num_candidates
        return 0 if rows > self.max_batch_rows else rows

    def _start_prefill(self, group: RequestGroup, plan: SchedulerOutput) -> None:
        """A prompt to prefill: its blocks reserved, its chunks computed by the coming steps."""
        job = ChunkedPrefill(group, self.prefill_chunk_tokens or len(group.prompt_ids))
        try:
            with self.runner.adapter(group.params.adapter):
                job.start(self.batch)
        except BaseException as exc:
            job.abandon(self.batch)
            plan.failed.append((group, exc))
            return
        self.prefilling.append(job)

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
            candidates += [(job.group.arrival, 1, job) for job in self.prefilling]
            if len(candidates) < 2:
                break  # one request alone always fits (the 400 check counts its blocks)
            _, prefilling, newest = max(candidates, key=lambda c: c[0])
            if prefilling:
                self.prefilling.remove(newest)
                newest.abandon(batch)
                group = newest.group
                group.status = Status.WAITING
            else:
                group = newest
                preempt(batch, group)
            self.preemptions += 1
            preempted.append(group)
            with self.lock:
                self.waiting.appendleft(group)
            log.info("KV blocks ran out: the newest request waits with its blocks given back (%d)", self.preemptions)
        return preempted

    def _plan(self) -> tuple[list[Chunk], list[list[Chunk]]]:
        """This step's prompt chunks: the prompts being prefilled, oldest first, within the step's token budget (the
        running rows' decode tokens count first), each at most a chunk (a step with a chunk is a decoding stream's
        inter-token gap). Those that use the running rows' adapter ride in the decode step's forward; the others
        are computed before it, one forward per adapter (one forward runs one adapter). Prompts whose clients went
        away leave first (their slots are free now)."""
        for job in [job for job in self.prefilling if job.group.cancelled]:
            self.prefilling.remove(job)
            job.abandon(self.batch)
            self.end(job.group)
        if not self.prefilling:
            return [], []
        by_adapter: dict[object, list[Chunk]] = {}
        one = self.prefill_tokens <= 0  # one prompt's chunk per step
        budget = self.prefilling[0].chunk if one else self.prefill_tokens - self.batch.rows
        for job in self.prefilling:
            if by_adapter and (one or budget <= 0):
                break
            chunk = job.next_chunk(max(1, budget))  # the oldest prompt moves on even when the rows fill the budget
            by_adapter.setdefault(job.group.params.adapter, []).append((job, chunk))
            budget -= len(chunk)
        riding = []
        if self.batch.groups and (not self.runner.adapters or self.batch.adapter is not MIXED):
            riding = by_adapter.pop(self.batch.adapter, [])
        return riding, list(by_adapter.values())

    # -- what the engine core's fault isolation asks ------------------------------------------------------------
    def admitted(self) -> list[RequestGroup]:
        """Every group out of the queue and not ended: prefilling, running, or admitted this step."""
        with self.lock:
            waiting = {id(g) for g in self.waiting}
            return [g for groups in self.requests.values() for g in groups if id(g) not in waiting]

    def forget_running(self) -> None:
        """After a failed step (the batch reset): no prompt is being prefilled, and rows parked for groups that no
        longer wait leave."""
        self.prefilling.clear()
        with self.lock:
            waiting = {g.arrival for g in self.waiting}
        for arrival in [a for a in self.batch.parked if a not in waiting]:
            del self.batch.parked[arrival]

    def take_all(self) -> list[RequestGroup]:
        """The engine stops: every group it has, the queue emptied."""
        with self.lock:
            self.waiting.clear()
            return [g for groups in self.requests.values() for g in groups]

    def inconsistency(self) -> str | None:
        """What is wrong with the engine's state between iterations, in words (None: nothing): every request's
        groups are waiting, prefilling or running; blocks are held by rows and prompts only; parked rows belong to
        waiting groups; every request holding a slot is in the engine."""
        batch = self.batch
        with self.lock:
            owned = {id(g) for groups in self.requests.values() for g in groups}
            pending = {id(g) for g in self.waiting}
            requests = set(self.requests)
            running_ids = set(self.admission._running)
            waiting_arrivals = {g.arrival for g in self.waiting}
        placed = pending | {id(g) for g in batch.groups} | {id(job.group) for job in self.prefilling}
        if owned != placed:
            return f"{len(owned - placed)} groups are nowhere, {len(placed - owned)} are placed but not owned"
        if not batch.groups and not self.prefilling and (batch.n or batch.prompts or batch.blocks.held_blocks):
            return f"nothing runs but {batch.n} rows, {batch.prompts} prompts, {batch.blocks.held_blocks} blocks remain"
        if batch.n != sum(g.rows for g in batch.groups):
            return f"the batch has {batch.n} rows, its groups {sum(g.rows for g in batch.groups)}"
        mirror = batch.mirror_problem()
        if mirror is not None:
            return mirror
        if set(batch.parked) - waiting_arrivals:
            return "rows are parked for groups that do not wait"
        if not running_ids <= requests:
            return "slots are held by requests the engine does not have"
        if not requests and batch.speculation is not None and batch.speculation.proposer.held_blocks():
            return f"the draft holds {batch.speculation.proposer.held_blocks()} blocks with no request in the engine"
        return None
