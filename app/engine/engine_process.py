"""The model loop in a process of its own (SAKER_ENGINE_PROCESS), as vLLM splits its engine core from its server.

In one process the model thread shares the interpreter with the request threads: while they parse HTTP, build
logprob keys and encode JSON, the model thread waits for the GIL between its operations. Here the engine process
owns the model, the scheduler and the sampler, and hands out numbers only; the serving process keeps HTTP,
tokenizing and the output side (``output.RequestDecoder`` on each request's thread).

One pipe carries everything, in order:

- to the engine: ``("submit", rid, [(tag, prompt ids, max_length)], params, eager)``, ``("cancel", rid)``,
  ``("finish", rid, tag, candidate)`` (a stop string ended a candidate);
- to the server: ``("ready", facts)`` once loaded (or ``("error", message)``), then per scheduler iteration one
  ``("events", [(rid, tag, events), ...], stats)``, and ``("done", rid, tag, timings)`` / ``("fail", rid, tag,
  error)`` per prompt.

The serving side's ``EngineClient`` looks like a ``Scheduler`` to the worker (``submit`` returns a ``Ticket``).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import threading
import time
from dataclasses import dataclass, field

from app.engine.errors import EngineNotReady
from app.engine.generate import RequestGroup
from app.engine.scheduler import _DONE, Ticket

log = logging.getLogger("saker.engine")


@dataclass
class EngineFacts:
    """What the serving side needs to know of the loaded model."""

    info: object  # worker.ModelInfo
    tokenizer: object
    eos_token_ids: tuple[int, ...]
    byte_level: bool
    adapters: tuple[str, ...]
    kv_cache_tokens: int
    load_seconds: float


@dataclass
class FrontRunner:
    """The serving side's stand-in for the ``ModelRunner``: what requests and the output side read of it."""

    tokenizer: object
    eos_token_ids: tuple[int, ...]
    byte_level: bool
    adapters: tuple[str, ...] = ()
    compiled_step: object = None
    input_device: object = field(default=None)


# -- the engine process -------------------------------------------------------------------------------------------
class _Outbox:
    """Events of one scheduler iteration, sent as one message when it ends."""

    def __init__(self, send):
        self.send = send
        self.items: list = []

    def flush(self, stats) -> None:
        if self.items:
            items, self.items = self.items, []
            self.send(("events", items, stats))


class _ForwardingTicket(Ticket):
    """The engine side of a request: the scheduler's events go to the pipe (every iteration when eager, else with
    the prompt's end), nothing is decoded here."""

    def __init__(self, groups, eager, rid, outbox: _Outbox, send):
        self.groups, self.eager, self.rid = groups, eager, rid
        self._outbox, self._send = outbox, send
        self._held: list = []
        self.submitted = time.perf_counter()

    def put(self, group, events) -> None:
        if not events:
            return
        if self.eager:
            self._outbox.items.append((self.rid, group.tag, events))
        else:
            self._held.append((self.rid, group.tag, events))

    def _hand_over(self, marker) -> None:
        self._outbox.items.extend(self._held)
        self._held = []
        self._outbox.flush(None)
        self._send(marker)

    def done(self, group) -> None:
        t = group.timings
        self._hand_over(("done", self.rid, group.tag, (t.queue_s, t.prefill_s, t.decode_s, t.cached_tokens)))

    def fail(self, group, exc) -> None:
        try:
            import pickle

            pickle.dumps(exc)
        except Exception:
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        self._hand_over(("fail", self.rid, group.tag, exc))


def engine_main(settings, conn) -> None:
    """The engine process: load (on a thread that exits, so the scheduler thread owns torch's thread pool), then
    serve the pipe until it closes."""
    from app.engine.worker import Worker

    from app.log_config import configure_logging

    configure_logging(settings)  # the serving processes' one format (text or JSON), in this process too
    worker = Worker.from_settings(settings.model_copy(update={"engine_process": False}))
    worker.load_in_background().join()
    if not worker.ready:
        conn.send(("error", worker.error or "model load failed"))
        return
    lock = threading.Lock()

    def send(message) -> None:
        with lock:
            conn.send(message)

    runner, scheduler = worker.runner, worker.scheduler
    outbox = _Outbox(send)
    scheduler.after_iteration = lambda: outbox.flush((scheduler.kv_usage, scheduler.steps, scheduler.preemptions))
    send(
        (
            "ready",
            EngineFacts(
                worker.info,
                runner.tokenizer,
                tuple(runner.eos_token_ids),
                runner.byte_level,
                tuple(runner.adapters),
                worker.kv_cache_tokens,
                worker.load_seconds or 0.0,
            ),
        )
    )
    requests: dict[int, list[RequestGroup]] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        kind = message[0]
        if kind == "submit":
            _, rid, items, params, eager = message
            groups = [
                RequestGroup(runner, ids, params, max_length=max_length, tag=tag) for tag, ids, max_length in items
            ]
            requests[rid] = groups
            scheduler.submit(groups, eager, ticket=_ForwardingTicket(groups, eager, rid, outbox, send))
        elif kind == "cancel":
            for group in requests.pop(message[1], ()):
                group.cancelled = True
        elif kind == "finish":
            _, rid, tag, index = message
            for group in requests.get(rid, ()):
                if group.tag == tag:
                    group.finish_candidate(index)
        elif kind == "forget":
            requests.pop(message[1], None)


# -- the serving side ---------------------------------------------------------------------------------------------
class _RemoteTicket(Ticket):
    def __init__(self, groups, eager, client: "EngineClient", rid: int):
        super().__init__(groups, eager)
        self.client, self.rid = client, rid
        self.remaining = len(groups)  # prompts the engine has not ended yet

    def cancel(self) -> None:
        super().cancel()
        self.client.send(("cancel", self.rid))

    def finish(self, group: RequestGroup, index: int) -> None:
        self.client.send(("finish", self.rid, group.tag, index))


class EngineClient:
    """The serving side of the pipe: starts the engine process, and stands in for its scheduler."""

    def __init__(self, settings):
        self.settings = settings
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=engine_main, args=(settings, child), name="saker-engine", daemon=True)
        self._lock = threading.Lock()
        self._tickets: dict[int, _RemoteTicket] = {}
        self._ids = itertools.count(1)
        self.kv_usage = 0.0
        self.steps = 0
        self.preemptions = 0
        self.max_rows_seen = 0
        self.waiting = 0
        self.facts: EngineFacts | None = None
        self.gone: str | None = None  # why the engine process is no longer there
        self.on_exit = None  # called with that reason (the worker turns not ready)

    def start(self) -> EngineFacts:
        """Start the engine and wait until it has loaded the model (ConfigError when it could not)."""
        from app.errors import ConfigError

        self.process.start()
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            raise ConfigError(f"the engine process exited while loading (code {self.process.exitcode})") from None
        if kind != "ready":
            raise ConfigError(payload)
        self.facts = payload
        threading.Thread(target=self._read, name="saker-engine-reader", daemon=True).start()
        return payload

    def send(self, message) -> None:
        """To the engine; a cancel, finish or forget for an engine that is gone has nothing left to stop."""
        try:
            with self._lock:
                self._conn.send(message)
        except OSError:
            if message[0] == "submit":
                raise EngineNotReady(self.gone or "the engine process is not running") from None

    def submit(self, groups: list[RequestGroup], eager: bool = True) -> Ticket:
        rid = next(self._ids)
        ticket = _RemoteTicket(groups, eager, self, rid)
        self._tickets[rid] = ticket
        self.send(("submit", rid, [(g.tag, g.prompt_ids, g.max_length) for g in groups], groups[0].params, eager))
        return ticket

    def _read(self) -> None:
        """Route the engine's messages to their tickets, in the order they come."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._engine_gone()
                return
            kind = message[0]
            if kind == "events":
                _, items, stats = message
                if stats is not None:
                    self.kv_usage, self.steps, self.preemptions = stats
                for rid, tag, events in items:
                    ticket = self._tickets.get(rid)
                    if ticket is not None:
                        ticket._events.put([(tag, events)])
            elif kind in ("done", "fail"):
                _, rid, tag, payload = message
                ticket = self._tickets.get(rid)
                if ticket is None:
                    continue
                if kind == "done":
                    for group in ticket.groups:
                        if group.tag == tag:
                            t = group.timings
                            t.queue_s, t.prefill_s, t.decode_s, t.cached_tokens = payload
                ticket._events.put([(tag, _DONE if kind == "done" else payload)])
                ticket.remaining -= 1
                if ticket.remaining == 0:
                    self._tickets.pop(rid, None)
                    self.send(("forget", rid))

    def _engine_gone(self) -> None:
        """The pipe closed: every waiting request fails with one clear error, and the worker stops being ready
        (/health 503) so that the replica is restarted."""
        self.process.join(5)
        self.gone = f"the engine process exited (code {self.process.exitcode})"
        log.error("saker: %s; failing %d waiting requests", self.gone, len(self._tickets))
        error = RuntimeError(self.gone)
        for ticket in list(self._tickets.values()):
            for group in ticket.groups:
                ticket._events.put([(group.tag, error)])
        self._tickets.clear()
        if self.on_exit is not None:
            self.on_exit(self.gone)

    def close(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
