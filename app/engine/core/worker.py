"""What the HTTP layer and the batch CLI talk to: loads the model's engine (in the background; an
``engine_core.EngineCore`` in this process, or one in the engine process through ``engine_process.EngineClient``),
then serves requests through it: its continuous batch, whose one waiting queue decides how many run at once and how
many may wait. ``ModelInfo`` and ``EngineConfig`` come from ``startup``."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Callable, Iterator

from app.engine.core.blocks import BLOCK
from app.engine.core.engine_core import EngineCore
from app.engine.core.engine_process import EngineClient, FrontRunner
from app.engine.core.startup import EngineConfig, ModelInfo, load_engine
from app.engine.errors import ClientGone, ConfigError, ConstraintError, EngineNotReady
from app.engine.events import PromptEvent, TokenEvent
from app.engine.core.sequence import RequestGroup
from app.engine.model.load_config import LoadConfig
from app.engine.model.loader import LoadedModel, load_model
from app.engine.model.oom import out_of_memory_guard
from app.engine.output.decoder import CompletionOutput, OutputStream, Release, collect
from app.engine.params import SamplingParams, Timings
from app.engine.model.runner import ModelRunner

log = logging.getLogger("saker.worker")


class Worker:
    def __init__(
        self,
        names: tuple[str, ...],
        loader: Callable[[], LoadedModel] | None,
        config: EngineConfig | None = None,
        **config_fields,
    ):
        self.names = names
        self._loader = loader  # None: the engine runs in an engine process (``_engine_settings``)
        self.config = config or EngineConfig(**config_fields)
        self.kv_cache_tokens = self.config.kv_cache_tokens  # the KV budget in use, once loaded
        self.engine: EngineCore | EngineClient | None = None  # the engine the requests go to
        self.load_seconds: float | None = None
        self._ready = threading.Event()
        self.error: str | None = None
        self.runner: ModelRunner | FrontRunner | None = None
        self.info: ModelInfo | None = None
        self._engine_settings = None  # SAKER_ENGINE_PROCESS: the settings the engine process loads with
        # the engine could not be made consistent again after a failed step (or its process exited): called with
        # the reason once every request in it has failed; the app makes the process exit (create_app)
        self.on_fatal: Callable[[str], None] | None = None

    @classmethod
    def from_settings(cls, settings) -> "Worker":
        config = EngineConfig.of(settings)
        if settings.engine_process:
            worker = cls(tuple(settings.model_names), None, config)
            worker._engine_settings = settings
            return worker
        load_config = LoadConfig.of(settings)  # what the loader reads of the settings
        return cls(tuple(settings.model_names), lambda: load_model(load_config), config)

    @classmethod
    def from_loaded(cls, names: tuple[str, ...], loaded: LoadedModel, **config_fields) -> "Worker":
        worker = cls(names, lambda: loaded, **config_fields)
        worker.load()
        return worker

    # -- loading ----------------------------------------------------------------------------------------
    def load(self) -> None:
        """Load the model and start its engine here (``startup.load_engine``) or in the engine process."""
        if self._engine_settings is not None:
            self._load_engine_process(self._engine_settings)
            return
        try:
            core = load_engine(self.names, self._loader, self.config)
        except ConfigError as exc:
            self.error = str(exc)
            raise
        self.runner, self.info, self.engine = core.runner, core.info, core
        self.kv_cache_tokens, self.load_seconds = core.kv_cache_tokens, core.load_seconds
        self.engine.on_fatal = self._engine_failed
        self._ready.set()

    def _load_engine_process(self, settings) -> None:
        """SAKER_ENGINE_PROCESS: the model loads and runs in the engine process; this one keeps its tokenizer and
        an ``EngineClient`` in the engine core's place."""
        client = EngineClient(settings)
        try:
            facts = client.start()
        except ConfigError as exc:
            self.error = str(exc)
            raise
        self.runner = FrontRunner(facts.tokenizer, facts.eos_token_ids, facts.byte_level, facts.adapters)
        self.info = facts.info
        self.kv_cache_tokens = facts.kv_cache_tokens
        self.engine = client
        self.load_seconds = facts.load_seconds

        client.on_exit = self._engine_failed
        log.info(
            "serving %s from %s in an engine process (pid %d)", self.names[0], self.info.source, client.process.pid
        )
        self._ready.set()

    def _engine_failed(self, reason: str) -> None:
        """The engine stopped (``EngineCore._stop``, or the engine process exited): not ready from now on (/health
        503), and ``on_fatal`` is told so that the process is replaced."""
        self.error = reason
        self._ready.clear()
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def stalled_s(self) -> float:
        """Seconds the engine has made no step while requests are in it (``/livez``); 0 before it is loaded."""
        engine = self.engine
        return engine.stalled_s() if engine is not None else 0.0

    @property
    def max_running_requests(self) -> int:
        """How many requests the engine admits at once (the batch CLI sends that many together)."""
        return self.config.running_requests

    @staticmethod
    def kv_positions(reach: int, candidates: int) -> tuple[int, int]:
        """The KV positions ``candidates`` sequences of ``reach`` positions each may take at most (whole blocks:
        what a request's admission is judged by), and the block size."""
        return candidates * -(-reach // BLOCK) * BLOCK, BLOCK

    def queue_snapshot(self) -> dict[str, int]:
        """The engine's waiting queue: requests running (holding a slot), waiting for one, turned away (429) and
        timed out (503); zeros before the model is loaded."""
        engine = self.engine
        if engine is None:
            return {"active": 0, "waiting": 0, "rejected": 0, "timed_out": 0}
        return engine.queue_snapshot()

    @property
    def prefix_cache(self):
        """The prefix cache's bookkeeping (``blocks.BlockManager``: its counters), None when it is off or the model
        runs in an engine process."""
        blocks = getattr(getattr(self.engine, "batch", None), "blocks", None)
        return blocks if blocks is not None and blocks.cached_limit else None

    def load_in_background(self, on_error: Callable[[str], None] | None = None) -> threading.Thread:
        def run():
            try:
                self.load()
            except ConfigError as exc:
                log.error("saker: %s", exc)
                if on_error:
                    on_error(str(exc))
            except Exception as exc:
                self.error = f"model load failed: {type(exc).__name__}: {exc}"
                log.exception("saker: model load failed")
                if on_error:
                    on_error(self.error)

        thread = threading.Thread(target=run, name="saker-load", daemon=True)
        thread.start()
        return thread

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def require_ready(self) -> ModelInfo:
        if not self._ready.is_set() or self.info is None:
            raise EngineNotReady(self.error or "the model is still loading; retry shortly")
        return self.info

    # -- tokens -----------------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        self.require_ready()
        return self.runner.tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def compile_constraint(self, constraint) -> None:
        """Compile a request's structured-output constraint before it is admitted (cached by constraint): one
        that llguidance cannot take raises ``ConstraintError`` with llguidance's message."""
        from app.engine.sampling.grammar import GrammarError, grammars_for

        info = self.require_ready()
        try:
            grammars_for(self.runner.tokenizer, info.vocab_size, tuple(self.runner.eos_token_ids)).compile(constraint)
        except GrammarError as exc:
            raise ConstraintError(str(exc)) from None

    # -- serving ----------------------------------------------------------------------------------------
    def events(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        max_length: int,
        timings: Timings,
        eager: bool = True,
        alive: Callable[[], bool] | None = None,
    ) -> Iterator[tuple[int, PromptEvent | TokenEvent]]:
        """Run the prompts (as groups of the engine's batch, side by side with other requests), yielding
        ``(prompt index, event)``. Closing the iterator (a dropped client) cancels the request: the
        engine drops it at the next step. Not ``eager``: events come when each prompt is done (stop strings
        still end a candidate as soon as they appear)."""
        self.require_ready()
        with out_of_memory_guard():
            groups = [
                RequestGroup(self.runner, ids, params, max_length=max_length, tag=p) for p, ids in enumerate(prompts)
            ]
            ticket = self.engine.submit(groups, eager=eager or bool(params.stop))
            if alive is not None:
                ticket.watch_client(alive)
            ended_early = True
            try:
                yield from ticket
                ended_early = False
            finally:
                ticket.unwatch_client()
                ticket.cancel()
                timings.queue_s = max(g.timings.queue_s for g in groups)
                timings.prefill_s += sum(g.timings.prefill_s for g in groups)
                timings.decode_s += max(g.timings.decode_s for g in groups)
                # a request cut short (its client left) counts what the engine made, handed over or not
                timings.generated_tokens += (
                    max(ticket.generated_tokens, sum(g.tokens_made for g in groups))
                    if ended_early
                    else ticket.generated_tokens
                )
                timings.cached_tokens += sum(g.timings.cached_tokens for g in groups)
                timings.draft_tokens += sum(g.timings.draft_tokens for g in groups)
                timings.accepted_tokens += sum(g.timings.accepted_tokens for g in groups)

    def stream(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        max_length: int,
        timings: Timings,
        alive: Callable[[], bool] | None = None,
    ) -> Iterator[tuple[int, Release]]:
        """``(prompt index, release)`` as each choice's text becomes final (stop strings held back). ``alive``: as
        for ``complete`` (a client that leaves before the first token stops the prefill's work too)."""
        outs = [OutputStream(params) for _ in prompts]
        events = self.events(prompts, params, max_length, timings, alive=alive)
        with contextlib.closing(events):
            for p, event in events:
                for release in outs[p].push(event):
                    yield p, release
        for p, out in enumerate(outs):
            for release in out.finish():
                yield p, release

    def complete(
        self, prompts: list[list[int]], params: SamplingParams, max_length: int, alive: Callable[[], bool] | None = None
    ) -> tuple[list[CompletionOutput], Timings]:
        """Every prompt to the end; the outputs in prompt order. ``alive``: whether the client is still there
        (asked while waiting; when it is gone the request is cancelled and ``ClientGone`` raised)."""
        timings = Timings()
        per_prompt: list[list[PromptEvent | TokenEvent]] = [[] for _ in prompts]
        try:
            for p, event in self.events(prompts, params, max_length, timings, eager=False, alive=alive):
                per_prompt[p].append(event)
        except ClientGone as exc:
            exc.timings = timings  # what was done before it stopped, for the access log
            raise
        return [collect(events, params) for events in per_prompt], timings
