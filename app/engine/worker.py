"""The one owner of the model in a process: loads it (in the background), and serves requests one at a
time under a lock. Concurrent callers wait their turn here."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from app.engine.admission import Admission
from app.engine.generate import Generator
from app.engine.output import CompletionOutput, OutputStream, Release, collect
from app.engine.loader import LoadedModel, load_model
from app.engine.oom import out_of_memory_as_503
from app.engine.params import SamplingParams, Timings
from app.engine.runner import ModelRunner
from app.errors import ConfigError, ModelNotReadyError

log = logging.getLogger("saker.worker")


@dataclass(frozen=True)
class ModelInfo:
    names: tuple[str, ...]            # main served name first, then aliases
    adapters: tuple[str, ...]         # named PEFT adapters, each its own model name
    context_length: int
    vocab_size: int
    source: str


def context_length(model, tokenizer) -> int:
    config = model.config
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, attr, None) or getattr(getattr(config, "text_config", None), attr, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    return value if isinstance(value, int) and 0 < value < 10 ** 9 else 2048


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
    def __init__(self, names: tuple[str, ...], loader: Callable[[], LoadedModel], admission: Admission | None = None):
        self.names = names
        self._loader = loader
        self._lock = threading.Lock()
        self.admission = admission or Admission()     # who may wait for the lock, and how long (429/503)
        self.load_seconds: float | None = None
        self._ready = threading.Event()
        self.error: str | None = None
        self.runner: ModelRunner | None = None
        self.info: ModelInfo | None = None

    @classmethod
    def from_settings(cls, settings) -> "Worker":
        return cls(tuple(settings.model_names), lambda: load_model(settings),
                   Admission(max_queue=settings.max_queue, timeout=settings.queue_timeout))

    @classmethod
    def from_loaded(cls, names: tuple[str, ...], loaded: LoadedModel) -> "Worker":
        worker = cls(names, lambda: loaded)
        worker.load()
        return worker

    # -- loading ----------------------------------------------------------------------------------------
    def load(self) -> None:
        try:
            loaded = self._loader()
        except ConfigError as exc:
            self.error = str(exc)
            raise
        model, tok = loaded.model, loaded.tokenizer
        self.runner = ModelRunner(model, tok, eos_ids(model, tok), tuple(loaded.adapters))
        self.info = ModelInfo(self.names, tuple(loaded.adapters), context_length(model, tok),
                              self.runner.vocab_size, loaded.source)
        self.warm_up()
        self.load_seconds = loaded.load_seconds
        log.info("serving %s as %s from %s (loaded in %.1f s, context %d)", self.names[0],
                 ", ".join(self.names + self.info.adapters), loaded.source, loaded.load_seconds,
                 self.info.context_length)
        self._ready.set()

    def warm_up(self) -> None:
        """One short greedy generation before /health turns 200, so the first request is not the slow one."""
        bos = self.runner.tokenizer.bos_token_id
        ids = [bos if bos is not None else 0]
        params = SamplingParams(max_tokens=2, temperature=0.0)
        collect(iter(Generator(self.runner, ids, params, max_length=self.info.context_length)), params)

    def load_in_background(self, on_error: Callable[[str], None] | None = None) -> threading.Thread:
        def run():
            try:
                self.load()
            except ConfigError as exc:
                log.error("saker: %s", exc)
                if on_error:
                    on_error(str(exc))
            except Exception as exc:   # noqa: BLE001 - reported as one line, the worker stays down
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
            raise ModelNotReadyError(self.error or "the model is still loading; retry shortly")
        return self.info

    # -- tokens -----------------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        self.require_ready()
        return self.runner.tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    # -- serving ----------------------------------------------------------------------------------------
    def stream(self, prompts: list[list[int]], params: SamplingParams, max_length: int, timings: Timings
               ) -> Iterator[tuple[int, Release]]:
        """Generate prompt after prompt under the lock, yielding (prompt index, release) as text becomes final.

        The lock is held while the caller iterates: closing the iterator (a dropped client) ends the
        generation at the current step and frees the worker."""
        self.require_ready()
        queued = time.perf_counter()
        with self.admission.slot(), self._lock, out_of_memory_as_503():
            timings.queue_s = time.perf_counter() - queued
            for p, ids in enumerate(prompts):
                step = Timings()
                out = OutputStream(params)
                try:
                    for release in out.feed(Generator(self.runner, ids, params, max_length=max_length,
                                                      timings=step)):
                        yield p, release
                finally:
                    timings.prefill_s += step.prefill_s
                    timings.decode_s += step.decode_s
                    timings.generated_tokens += out.completion_tokens

    def complete(self, prompts: list[list[int]], params: SamplingParams, max_length: int
                 ) -> tuple[list[CompletionOutput], Timings]:
        """Run every prompt (in order) under the lock; timings summed over prompts."""
        self.require_ready()
        timings = Timings()
        queued = time.perf_counter()
        with self.admission.slot(), self._lock, out_of_memory_as_503():
            timings.queue_s = time.perf_counter() - queued
            outputs = []
            for ids in prompts:
                step = Timings()
                outputs.append(collect(iter(Generator(self.runner, ids, params, max_length=max_length,
                                                      timings=step)), params))
                timings.prefill_s += step.prefill_s
                timings.decode_s += step.decode_s
                timings.generated_tokens += outputs[-1].completion_tokens
        return outputs, timings
