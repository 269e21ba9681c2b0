"""The one owner of the model in a process: loads it (in the background), then serves requests through the
scheduler's continuous batch, whose one waiting queue decides how many run at once and how many may wait."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from app.engine.errors import ClientGone, ConstraintError, EngineNotReady
from app.engine.events import PromptEvent, TokenEvent
from app.engine.generate import RequestGroup, SoloRun
from app.engine.output import CompletionOutput, OutputStream, Release, collect
from app.engine.loader import LoadedModel, load_model
from app.engine.oom import out_of_memory_guard
from app.engine.params import SamplingParams, Timings
from app.engine.runner import ModelRunner
from app.engine.scheduler import Scheduler
from app.engine.speculative import SpeculativeConfig
from app.errors import ConfigError

log = logging.getLogger("saker.worker")


@dataclass(frozen=True)
class ModelInfo:
    names: tuple[str, ...]  # main served name first, then aliases
    adapters: tuple[str, ...]  # named PEFT adapters, each its own model name
    context_length: int
    vocab_size: int
    source: str
    precision: str = "float32"  # the weights and activations served, in words


def context_length(model, tokenizer) -> int:
    config = model.config
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, attr, None) or getattr(getattr(config, "text_config", None), attr, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    return value if isinstance(value, int) and 0 < value < 10**9 else 2048


def eos_ids(model, tokenizer) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


class Worker:
    def __init__(
        self,
        names: tuple[str, ...],
        loader: Callable[[], LoadedModel],
        *,
        max_batch_rows: int = 8,
        max_running_requests: int | None = None,
        max_queue: int | None = None,
        queue_timeout: float | None = None,
        compile: bool | None = False,
        prefill_batch_tokens: int = 512,
        prefix_cache_tokens: int = 4096,
        prefill_chunk_tokens: int = 32,
        kv_cache_tokens: int | None = None,
        speculative: SpeculativeConfig | None = None,
    ):
        self.names = names
        self._loader = loader
        self.max_batch_rows = max_batch_rows  # candidate rows in the scheduler's decode batch
        self.prefill_batch_tokens = prefill_batch_tokens  # prompt tokens one step computes (0: one prompt's chunk)
        self.prefix_cache_tokens = prefix_cache_tokens  # prompt tokens whose KV is kept for reuse (0: off)
        self.prefill_chunk_tokens = prefill_chunk_tokens  # a prompt's tokens per step while rows decode (0: all)
        self.kv_cache_tokens = kv_cache_tokens  # the decode batch's KV budget (None: derived at load)
        self.compile = compile  # SAKER_COMPILE: compiled decode step (None: on CUDA only)
        self.speculative = speculative  # SAKER_SPECULATIVE* (None: off)
        self.scheduler: Scheduler | None = None
        # how many requests run at once (None: as many as the batch has rows), how many may wait and how long
        self.max_running_requests = max_running_requests or max_batch_rows
        self.max_queue, self.queue_timeout = max_queue, queue_timeout
        self.load_seconds: float | None = None
        self._ready = threading.Event()
        self.error: str | None = None
        self.runner: ModelRunner | None = None
        self.info: ModelInfo | None = None
        # the engine could not be made consistent again after a failed step (or its process exited): called with
        # the reason once every request in it has failed; the app makes the process exit (create_app)
        self.on_fatal: Callable[[str], None] | None = None

    @classmethod
    def from_settings(cls, settings) -> "Worker":
        queue = {
            "max_running_requests": settings.max_running_requests,
            "max_queue": settings.max_queue,
            "queue_timeout": settings.queue_timeout,
        }
        if settings.engine_process:
            worker = cls(tuple(settings.model_names), None, max_batch_rows=settings.max_batch_rows, **queue)
            worker._engine_settings = settings
            return worker
        return cls(
            tuple(settings.model_names),
            lambda: load_model(settings),
            **queue,
            max_batch_rows=settings.max_batch_rows,
            prefill_batch_tokens=settings.prefill_batch_tokens,
            prefix_cache_tokens=settings.prefix_cache_tokens,
            prefill_chunk_tokens=settings.prefill_chunk_tokens,
            kv_cache_tokens=settings.kv_cache_tokens,
            compile=settings.compile,
            speculative=SpeculativeConfig.of(settings),
        )

    @classmethod
    def from_loaded(cls, names: tuple[str, ...], loaded: LoadedModel, **kwargs) -> "Worker":
        worker = cls(names, lambda: loaded, **kwargs)
        worker.load()
        return worker

    # -- loading ----------------------------------------------------------------------------------------
    def load(self) -> None:
        """Load the model, warm it up and start the scheduler thread.

        The work runs on a thread of its own that exits when it is done. torch's CPU thread pool (OpenMP) belongs
        to the thread that first runs a parallel operation and lives as long as that thread. A caller that loaded
        on its own long-lived thread (a script's main thread, the batch CLI) would keep a second pool beside the
        scheduler thread's; with more OpenMP threads than cores, OpenMP stops spinning and puts its workers to
        sleep between operations, and every small operation of a decode step pays a wake-up. On the 2-core
        machine the embedded model decoded at 33-38 ms/token that way, against 18.5-19.3 when loaded like this."""
        if getattr(self, "_engine_settings", None) is not None:
            self._load_engine_process(self._engine_settings)
            return
        failure: list[BaseException] = []

        def run() -> None:
            try:
                self._load_and_start()
            except BaseException as exc:  # re-raised on the caller's thread
                failure.append(exc)

        loader = threading.Thread(target=run, name="saker-load")
        loader.start()
        loader.join()
        if failure:
            raise failure[0]

    def _load_and_start(self) -> None:
        try:
            loaded = self._loader()
        except ConfigError as exc:
            self.error = str(exc)
            raise
        model, tok = loaded.model, loaded.tokenizer
        self.runner = ModelRunner(model, tok, eos_ids(model, tok), tuple(loaded.adapters))
        self.info = ModelInfo(
            self.names,
            tuple(loaded.adapters),
            context_length(model, tok),
            self.runner.vocab_size,
            loaded.source,
            loaded.precision,
        )
        self.warm_up()
        self.scheduler = Scheduler(
            self.runner,
            max_batch_rows=self.max_batch_rows,
            prefill_tokens=self.prefill_batch_tokens,
            prefill_chunk_tokens=self.prefill_chunk_tokens,
            kv_cache_tokens=self.kv_cache_tokens,
            prefix_cache_tokens=self.prefix_cache_tokens,
            max_running_requests=self.max_running_requests,
            max_queue=self.max_queue,
            queue_timeout=self.queue_timeout,
            speculative=self.speculative,
        )
        self.scheduler.on_fatal = self._engine_failed
        # the pool now: its default budget (90 % of the free GPU memory) is taken once a draft model holds its own
        self.kv_cache_tokens = self.scheduler.batch.make_pool()
        if self.compile if self.compile is not None else self.runner.input_device.type == "cuda":
            self.compile_decode_step()
        self.scheduler.start()
        self.load_seconds = loaded.load_seconds
        log.info(
            "serving %s as %s from %s (loaded in %.1f s, context %d, %s)",
            self.names[0],
            ", ".join(self.names + self.info.adapters),
            loaded.source,
            loaded.load_seconds,
            self.info.context_length,
            loaded.precision,
        )
        self._ready.set()

    def _load_engine_process(self, settings) -> None:
        """SAKER_ENGINE_PROCESS: the model loads and runs in the engine process; this one keeps its tokenizer and
        an ``EngineClient`` in the scheduler's place."""
        from app.engine.engine_process import EngineClient, FrontRunner

        client = EngineClient(settings)
        try:
            facts = client.start()
        except ConfigError as exc:
            self.error = str(exc)
            raise
        self.runner = FrontRunner(facts.tokenizer, facts.eos_token_ids, facts.byte_level, facts.adapters)
        self.info = facts.info
        self.kv_cache_tokens = facts.kv_cache_tokens
        self.scheduler = client
        self.load_seconds = facts.load_seconds

        client.on_exit = self._engine_failed
        log.info(
            "serving %s from %s in an engine process (pid %d)", self.names[0], self.info.source, client.process.pid
        )
        self._ready.set()

    def _engine_failed(self, reason: str) -> None:
        """The engine stopped (``Scheduler._stop``, or the engine process exited): not ready from now on (/health
        503), and ``on_fatal`` is told so that the process is replaced."""
        self.error = reason
        self._ready.clear()
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def stalled_s(self) -> float:
        """Seconds the engine has made no step while requests are in it (``/livez``); 0 before it is loaded."""
        engine = self.scheduler
        return engine.stalled_s() if engine is not None else 0.0

    def warm_up(self) -> None:
        """One short greedy generation before /health turns 200, so the first request is not the slow one."""
        bos = self.runner.tokenizer.bos_token_id
        ids = [bos if bos is not None else 0]
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        collect(iter(SoloRun(self.runner, ids, params, max_length=self.info.context_length)), params)

    def compile_decode_step(self) -> None:
        """SAKER_COMPILE: compile the decode-only step and run it once per batch bucket (and window) on the
        scheduler's own pool, so that no request pays a compile or a CUDA graph capture. Models whose cache cannot be
        kept in blocks decode eagerly."""
        batch = self.scheduler.batch
        if not hasattr(batch, "warm_up"):
            log.warning("SAKER_COMPILE: this model's cache cannot be kept in blocks; decoding eagerly")
            return
        start = time.perf_counter()
        self.runner.compile_step()
        import torch

        with torch.inference_mode():
            batch.warm_up(self.max_batch_rows, self.info.context_length)
        log.info(
            "compiled the decode step for batches up to %d rows, windows up to %d positions (%.1f s)",
            self.max_batch_rows,
            batch.capacity,
            time.perf_counter() - start,
        )

    def queue_snapshot(self) -> dict[str, int]:
        """The engine's waiting queue: requests running (holding a slot), waiting for one, turned away (429) and
        timed out (503); zeros before the model is loaded."""
        engine = self.scheduler
        if engine is None:
            return {"active": 0, "waiting": 0, "rejected": 0, "timed_out": 0}
        return engine.queue_snapshot()

    @property
    def prefix_cache(self):
        """The prefix cache's bookkeeping (``blocks.BlockManager``: its counters), None when it is off or the model
        runs in an engine process."""
        blocks = getattr(getattr(getattr(self, "scheduler", None), "batch", None), "blocks", None)
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
        from app.engine.grammar import GrammarError, grammars_for

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
        """Run the prompts (as groups of the scheduler's batch, side by side with other requests), yielding
        ``(prompt index, event)``. Closing the iterator (a dropped client) cancels the request: the
        scheduler drops it at the next step. Not ``eager``: events come when each prompt is done (stop strings
        still end a candidate as soon as they appear)."""
        self.require_ready()
        with out_of_memory_guard():
            groups = [
                RequestGroup(self.runner, ids, params, max_length=max_length, tag=p) for p, ids in enumerate(prompts)
            ]
            ticket = self.scheduler.submit(groups, eager=eager or bool(params.stop))
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
