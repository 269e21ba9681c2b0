"""The model loop in a process of its own (SAKER_ENGINE_PROCESS), as vLLM splits its engine core from its server.

In one process the model thread shares the interpreter with the request threads: while they parse HTTP, build
logprob keys and encode JSON, the model thread waits for the GIL between its operations. Here the engine process
owns the model and its engine core (scheduler, batch, sampler), and hands out numbers only; the serving process
keeps HTTP, tokenizing and the output side (``output.RequestDecoder`` on each request's thread).

One pipe carries the engine interface (``client.Engine``), in order:

- to the engine: ``("add", rid, [(tag, prompt ids, max_length)], params, eager)``, ``("abort", rid)``,
  ``("finish", rid, tag, candidate)`` (a stop string ended a candidate);
- to the server: ``("ready", facts)`` once loaded (or ``("error", message)``), then per engine iteration its
  outputs, ``("outputs", [(rid, tag, payload), ...], stats)``, exactly what the in-process engine core hands to
  ``Engine.route``.

The serving side's ``EngineClient`` is an ``Engine`` like the in-process ``EngineCore``: the worker cannot tell them
apart.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import threading
import time
from dataclasses import dataclass, field

from app.engine.core.client import Engine
from app.engine.errors import ConfigError, EngineNotReady, QueueFull
from app.engine.core.sequence import RequestGroup

log = logging.getLogger("saker.engine")
HEARTBEAT_S = 1.0  # how often the engine process sends its counters when it has nothing else to send


@dataclass
class EngineFacts:
    """What the serving side needs to know of the loaded model."""

    info: object  # core.ModelInfo
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
def engine_main(settings, conn) -> None:
    """The engine process: load (on a thread that exits, so the engine thread owns torch's thread pool), then
    serve the pipe until it closes."""
    from app.engine.core.startup import EngineConfig, load_engine
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model

    setup_logging = getattr(settings, "configure_logging", None)  # the server's Settings: its log format
    if setup_logging is not None:
        setup_logging()  # the serving processes' one format (text or JSON), in this process too
    load_config = LoadConfig.of(settings)
    try:
        core = load_engine(tuple(settings.model_names), lambda: load_model(load_config), EngineConfig.of(settings))
    except ConfigError as exc:
        conn.send(("error", str(exc)))
        return
    except Exception as exc:
        log.exception("saker: model load failed")
        conn.send(("error", f"model load failed: {type(exc).__name__}: {exc}"))
        return
    lock = threading.Lock()

    def send(message) -> None:
        with lock:
            conn.send(message)

    runner, engine = core.runner, core

    def stats() -> tuple:
        counts = engine.speculation_counts
        snapshot = engine.queue_snapshot()
        health = engine.stalled_s(), engine.failures, engine.repairs
        return engine.kv_usage, engine.steps, engine.preemptions, snapshot, counts, health

    engine.deliver = lambda outputs: send(("outputs", _picklable(outputs), stats()))

    def fatal(reason: str) -> None:  # every request has heard (``EngineCore._stop`` flushed): the process goes
        log.critical("saker: the engine process exits: %s", reason)
        conn.close()
        os._exit(70)

    engine.on_fatal = fatal

    def heartbeat() -> None:  # the serving side's liveness clock: the loop's own, and this process's being there
        while True:
            time.sleep(HEARTBEAT_S)
            try:
                send(("outputs", [], stats()))
            except OSError:
                return

    threading.Thread(target=heartbeat, name="saker-engine-heartbeat", daemon=True).start()
    send(
        (
            "ready",
            EngineFacts(
                core.info,
                runner.tokenizer,
                tuple(runner.eos_token_ids),
                runner.byte_level,
                tuple(runner.adapters),
                core.kv_cache_tokens,
                core.load_seconds or 0.0,
            ),
        )
    )
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        kind = message[0]
        if kind == "add":
            _, rid, items, params, eager = message
            groups = [
                RequestGroup(runner, ids, params, max_length=max_length, tag=tag) for tag, ids, max_length in items
            ]
            try:
                engine.add_request(rid, groups, eager)
            except QueueFull as exc:  # the queue's answer comes back as the request's failure
                send(("outputs", [(rid, g.tag, exc) for g in groups], stats()))
        elif kind == "abort":
            engine.abort(message[1])
        elif kind == "finish":
            engine.finish(*message[1:])


def _picklable(outputs: list) -> list:
    """A failure whose exception cannot be pickled crosses the pipe as a RuntimeError naming it."""
    out = []
    for rid, tag, payload in outputs:
        if isinstance(payload, BaseException):
            try:
                pickle.dumps(payload)
            except Exception:
                payload = RuntimeError(f"{type(payload).__name__}: {payload}")
        out.append((rid, tag, payload))
    return out


# -- the serving side ---------------------------------------------------------------------------------------------
class EngineClient(Engine):
    """The serving side of the pipe: starts the engine process and carries the engine interface to it."""

    def __init__(self, settings):
        super().__init__()
        self.settings = settings
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=engine_main, args=(settings, child), name="saker-engine", daemon=True)
        self._lock = threading.Lock()
        self.kv_usage = 0.0
        self.steps = 0
        self.preemptions = 0
        self.speculation_counts: dict | None = None  # SAKER_SPECULATIVE's counters, as of the last message
        self.max_rows_seen = 0
        self._queue = {"active": 0, "waiting": 0, "rejected": 0, "timed_out": 0}
        self.facts: EngineFacts | None = None
        self.gone: str | None = None  # why the engine process is no longer there
        self._stalled = 0.0  # the engine loop's stall as of the last message (``EngineCore.stalled_s``)
        self.failures = self.repairs = 0  # the engine core's counters of failed steps and repaired leaks
        self._heard = time.monotonic()  # when the last message came
        self.on_exit = None  # called with that reason (the worker turns not ready)

    def start(self) -> EngineFacts:
        """Start the engine and wait until it has loaded the model (ConfigError when it could not)."""
        self.process.start()
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            raise ConfigError(f"the engine process exited while loading (code {self.process.exitcode})") from None
        if kind != "ready":
            raise ConfigError(payload)
        self.facts = payload
        self.tokenizer, self.byte_level = payload.tokenizer, payload.byte_level
        threading.Thread(target=self._read, name="saker-engine-reader", daemon=True).start()
        return payload

    def send(self, message) -> None:
        """To the engine; an abort or finish for an engine that is gone has nothing left to stop."""
        try:
            with self._lock:
                self._conn.send(message)
        except OSError:
            if message[0] == "add":
                raise EngineNotReady(self.gone or "the engine process is not running") from None

    def add_request(self, rid: int, groups: list[RequestGroup], eager: bool) -> None:
        if self.gone is not None:
            raise EngineNotReady(self.gone)
        self.send(("add", rid, [(g.tag, g.prompt_ids, g.max_length) for g in groups], groups[0].params, eager))

    def abort(self, rid: int) -> None:
        self.send(("abort", rid))

    def finish(self, rid: int, tag: int, index: int) -> None:
        self.send(("finish", rid, tag, index))

    def _read(self) -> None:
        """Route the engine's messages to their tickets, in the order they come."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._engine_gone()
                return
            _, outputs, stats = message  # "outputs"
            self._heard = time.monotonic()
            self.kv_usage, self.steps, self.preemptions, self._queue, self.speculation_counts, health = stats
            self._stalled, self.failures, self.repairs = health
            if outputs:
                self.route(outputs)

    def stalled_s(self) -> float:
        """The engine loop's stall while requests are open: as the engine process last said, or the time since it
        said anything (its heartbeat comes every ``HEARTBEAT_S``), whichever is longer."""
        if self.gone is not None:
            return float("inf")
        if not self.open_requests:
            return 0.0
        return max(self._stalled, time.monotonic() - self._heard - HEARTBEAT_S)

    def queue_snapshot(self) -> dict[str, int]:
        """The engine's waiting queue as of its last iteration's message."""
        return dict(self._queue)

    def _engine_gone(self) -> None:
        """The pipe closed: every waiting request fails with one clear error, and the worker stops being ready
        (/health 503) so that the replica is restarted."""
        self.process.join(5)
        self.gone = f"the engine process exited (code {self.process.exitcode})"
        log.error("saker: %s; failing %d waiting requests", self.gone, self.open_requests)
        self.fail_all(RuntimeError(self.gone))
        if self.on_exit is not None:
            self.on_exit(self.gone)

    def close(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
