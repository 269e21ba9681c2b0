"""One engine interface for the in-process engine and the engine process alike (vLLM's ``EngineCoreClient``).

An engine takes requests (``add_request(rid, groups, eager)``), aborts them (``abort(rid)``), ends a candidate a
stop string ended (``finish(rid, tag, index)``), and hands out its outputs keyed by request id: after each
engine iteration one list of ``(rid, tag, payload)``, where a payload is a list of a prompt's engine events
(numbers), ``Ended`` (the prompt is done, with its timings) or an exception (it failed). ``Engine.route`` gives
each output to its request's ``Ticket``: the reader side, which turns numbers into text events on the request's
own thread. ``engine_core.EngineCore`` is the in-process engine (its outputs go straight to ``route``);
``engine_process.EngineClient`` sends the same calls over a pipe to an engine core in another process and routes
what comes back.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from app.engine.errors import ClientGone
from app.engine.events import PromptEvent, TokenEvent

if TYPE_CHECKING:
    from app.engine.core.sequence import RequestGroup


@dataclass(frozen=True)
class Ended:
    """A prompt's last output: it is done (every candidate ended, or it was cancelled), with its timings."""

    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    cached_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @classmethod
    def of(cls, group: RequestGroup) -> "Ended":
        t = group.timings
        return cls(t.queue_s, t.prefill_s, t.decode_s, t.cached_tokens, t.draft_tokens, t.accepted_tokens)


class Ticket:
    """A request's view of its groups: iterate for ``(tag, event)``; ``cancel()`` when the client is gone.

    The engine's outputs for this request come an engine iteration at a time (``deliver``); iterating turns
    them into text events on the reader's thread (``output.RequestDecoder``), so detokenizing, stop strings and
    logprob keys never run on the model thread. The engine sends an ``eager`` request's outputs (a stream, a
    request with stop strings) every iteration, another one's only when one of its prompts ends, so that many
    waiting requests do not take the interpreter from the model thread at every step."""

    def __init__(self, engine: "Engine", rid: int, groups: list[RequestGroup], eager: bool = True):
        from app.engine.output.decoder import RequestDecoder

        self.engine, self.rid = engine, rid
        self.groups = groups
        self.eager = eager
        self.decoders = {
            group.tag: RequestDecoder(group, engine.tokenizer, engine.byte_level, self.finish) for group in groups
        }
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._ready: collections.deque[tuple[int, PromptEvent | TokenEvent]] = collections.deque()
        self._open = len(groups)

    def deliver(self, items: list[tuple[int, object]]) -> None:
        """From the engine's side: ``(tag, payload)`` outputs of one iteration."""
        self._events.put(items)

    @property
    def generated_tokens(self) -> int:
        """Tokens handed to the reader so far (a row that ran past its stop string counts only up to it)."""
        return sum(d.generated_tokens for d in self.decoders.values())

    def cancel(self) -> None:
        """The request is aborted (its client went away): its groups leave at the engine's next step."""
        self.engine.abort(self.rid)

    def finish(self, group: RequestGroup, index: int) -> None:
        """The output side ended candidate ``index`` of ``group`` (a stop string): its row leaves at the next step."""
        self.engine.finish(self.rid, group.tag, index)

    alive = None  # a callable: False once the reader's client is gone (checked while waiting)
    POLL_S = 0.05  # how often the reader asks, when nothing tells it
    WATCHED_POLL_S = 0.25  # a safety net only, when the client's close wakes the reader itself
    _checked = 0.0
    _unwatch = None

    def watch_client(self, alive) -> None:
        """Cancel when ``alive()`` turns False: at once when ``alive`` can tell us (``alive.watch(callback)``, e.g.
        an epoll on the client's socket; then asked only every ``WATCHED_POLL_S``, so that waiting readers do not
        take the interpreter from the model thread), otherwise asked every ``POLL_S`` while the reader waits or
        events flow."""
        self.alive = alive
        watch = getattr(alive, "watch", None)
        self._unwatch = watch(self.wake) if watch is not None else None
        if self._unwatch is not None:
            self.POLL_S = self.WATCHED_POLL_S

    def unwatch_client(self) -> None:
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None

    def wake(self) -> None:
        """From another thread: the client may have gone; the reader asks at once."""
        self._checked = float("-inf")
        self._events.put([])

    def _next_batch(self) -> list:
        """The next message; with ``alive`` set, a client that went away cancels the request: checked while it
        waits, and at least every ``POLL_S`` while events flow (a stream, a request with stop strings)."""
        if self.alive is None:
            return self._events.get()
        while True:
            now = time.perf_counter()
            if now - self._checked >= self.POLL_S:
                self._checked = now
                self._check_alive()
            try:
                return self._events.get(timeout=self.POLL_S)
            except queue.Empty:
                self._checked = time.perf_counter()
                self._check_alive()

    def _check_alive(self) -> None:
        if not self.alive():
            self.cancel()
            raise ClientGone() from None

    def __iter__(self) -> Iterator[tuple[int, PromptEvent | TokenEvent]]:
        while self._ready:  # decoded before an earlier iteration stopped (events come a step at a time)
            yield self._ready.popleft()
        while self._open:
            failure = None
            for tag, item in self._next_batch():  # all decoded before any is yielded: a reader may stop between
                if isinstance(item, Ended):
                    self._open -= 1
                    for group in self.groups:  # the engine's timings (the same object in process: no change)
                        if group.tag == tag:
                            t = group.timings
                            t.queue_s, t.prefill_s, t.decode_s, t.cached_tokens = (
                                item.queue_s,
                                item.prefill_s,
                                item.decode_s,
                                item.cached_tokens,
                            )
                            t.draft_tokens, t.accepted_tokens = item.draft_tokens, item.accepted_tokens
                elif isinstance(item, BaseException):
                    failure = item
                    break
                else:
                    decoder = self.decoders[tag]
                    self._ready.extend((tag, event) for numbers in item for event in decoder.push(numbers))
            while self._ready:
                yield self._ready.popleft()
            if failure is not None:
                self.cancel()
                raise failure


class Engine:
    """What the worker talks to: ``submit`` a request's groups and read its ``Ticket``. Subclasses carry the
    request to the engine (``add_request``, ``abort``, ``finish``); ``route`` hands each output to its ticket.
    ``tokenizer`` and ``byte_level``: what the tickets' output side needs of the model."""

    tokenizer = None
    byte_level = False

    def __init__(self):
        self._tickets: dict[int, Ticket] = {}
        self._open: dict[int, int] = {}  # prompts of each request not ended yet
        self._ids = itertools.count(1)
        self._route_lock = threading.Lock()

    def submit(self, groups: list[RequestGroup], eager: bool = True) -> Ticket:
        """Queue the groups (prompts) of one request; their outputs come through the returned ticket."""
        rid = next(self._ids)
        ticket = Ticket(self, rid, groups, eager)
        with self._route_lock:
            self._tickets[rid] = ticket
            self._open[rid] = len(groups)
        try:
            self.add_request(rid, groups, eager)
        except BaseException:
            self._drop(rid)
            raise
        return ticket

    def route(self, items: list[tuple[int, int, object]]) -> None:
        """One iteration's outputs to their tickets (one message per ticket); a request whose prompts have all
        ended is forgotten."""
        by_rid: dict[int, list[tuple[int, object]]] = {}
        for rid, tag, payload in items:
            by_rid.setdefault(rid, []).append((tag, payload))
        with self._route_lock:
            for rid, outputs in by_rid.items():
                ticket = self._tickets.get(rid)
                if ticket is None:
                    continue
                ticket.deliver(outputs)
                ended = sum(isinstance(p, (Ended, BaseException)) for _, p in outputs)
                if ended:
                    self._open[rid] -= ended
                    if self._open[rid] <= 0:
                        self._drop_locked(rid)

    def fail_all(self, error: BaseException) -> None:
        """Every open request fails with ``error`` (the engine is gone)."""
        with self._route_lock:
            tickets, self._tickets, self._open = list(self._tickets.values()), {}, {}
        for ticket in tickets:
            ticket.deliver([(group.tag, error) for group in ticket.groups])

    @property
    def open_requests(self) -> int:
        return len(self._tickets)

    def _drop(self, rid: int) -> None:
        with self._route_lock:
            self._drop_locked(rid)

    def _drop_locked(self, rid: int) -> None:
        self._tickets.pop(rid, None)
        self._open.pop(rid, None)

    # -- what an engine implements ------------------------------------------------------------------------------
    def add_request(self, rid: int, groups: list[RequestGroup], eager: bool) -> None:
        raise NotImplementedError

    def abort(self, rid: int) -> None:
        raise NotImplementedError

    def finish(self, rid: int, tag: int, index: int) -> None:
        raise NotImplementedError
