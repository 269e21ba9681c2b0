"""How an engine starts: a loaded model's runner and facts, warmed up (and its decode step compiled where asked),
and the ``EngineCore`` whose loop steps it, started (``load_engine``). The worker starts one in its own process, or
the engine process starts one (``engine_process.engine_main``) and the worker talks to it over a pipe: either way it
is started here, so neither side imports the other. ``EngineConfig`` is the engine's settings, ``ModelInfo`` the
model's facts the server reads.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

from app.engine.core.solo import SoloRun
from app.engine.model.loader import LoadedModel
from app.engine.output.decoder import collect
from app.engine.params import SamplingParams
from app.engine.model.kv_cache import BLOCK
from app.engine.model.runner import COMPILE_FLAT_BY_DEFAULT, FlatSizes, ModelRunner, eos_ids
from app.engine.model.shapes import bucket
from app.engine.core.engine_core import EngineCore
from app.engine.core.speculative import SpeculativeConfig

log = logging.getLogger("saker.worker")  # the line operators grep for: "saker.worker: serving ..."


@dataclass(frozen=True)
class ModelInfo:
    names: tuple[str, ...]  # main served name first, then aliases
    adapters: tuple[str, ...]  # named PEFT adapters, each its own model name
    context_length: int
    vocab_size: int
    source: str
    precision: str = "float32"  # the weights and activations served, in words


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches and caches (the engine's settings, ``EngineConfig.of(settings)``)."""

    max_batch_rows: int = 8  # candidate rows in the scheduler's decode batch
    max_running_requests: int | None = None  # requests admitted at once (None: as many as the batch has rows)
    max_queue: int | None = None  # requests that may wait (None: any number)
    queue_timeout: float | None = None  # seconds a request may wait (None: forever)
    compile: bool | None = False  # SAKER_COMPILE (None: CUDA's decode step; the CPU's flat step where the default)
    prefill_batch_tokens: int = 512  # prompt tokens one step computes (0: one prompt's chunk)
    prefix_cache_tokens: int = 4096  # prompt tokens whose KV is kept for reuse (0: off)
    prefill_chunk_tokens: int = 32  # a prompt's tokens per step while rows decode (0: all)
    kv_cache_tokens: int | None = None  # the decode batch's KV budget (None: derived at load)
    speculative: SpeculativeConfig | None = None  # SAKER_SPECULATIVE* (None: off)
    threads: int | None = None  # torch's CPU threads for the model loop (None: torch's default, every core)

    @property
    def running_requests(self) -> int:
        return self.max_running_requests or self.max_batch_rows

    @classmethod
    def of(cls, settings) -> "EngineConfig":
        return cls(
            max_batch_rows=settings.max_batch_rows,
            max_running_requests=settings.max_running_requests,
            max_queue=settings.max_queue,
            queue_timeout=settings.queue_timeout,
            compile=settings.compile,
            prefill_batch_tokens=settings.prefill_batch_tokens,
            prefix_cache_tokens=settings.prefix_cache_tokens,
            prefill_chunk_tokens=settings.prefill_chunk_tokens,
            kv_cache_tokens=settings.kv_cache_tokens,
            speculative=SpeculativeConfig.of(settings),
            threads=engine_threads(settings.engine_threads, settings.engine_process),
        )


def engine_threads(requested: int | None, own_process: bool) -> int | None:
    """torch's CPU threads for the model loop: as asked; in an engine process of its own, one core fewer than this
    process may use (as vLLM's CPU worker leaves one to its front end), so that the serving process's HTTP and
    output work do not take cores from the model's threads (nor their spinning from it); otherwise torch's
    default."""
    if requested:
        return requested
    if not own_process:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


def load_engine(names: tuple[str, ...], loader: Callable[[], LoadedModel], config: EngineConfig) -> EngineCore:
    """Load the model, warm it up and start the engine core's thread, all on a thread of its own that exits when it
    is done (errors re-raised here).

    torch's CPU thread pool (OpenMP) belongs to the thread that first runs a parallel operation and lives as long
    as that thread. A caller that loaded on its own long-lived thread (a script's main thread, the batch CLI) would
    keep a second pool beside the engine thread's; with more OpenMP threads than cores, OpenMP stops spinning and
    puts its workers to sleep between operations, and every small operation of a decode step pays a wake-up. On the
    2-core machine the embedded model decoded at 33-38 ms/token that way, against 18.5-19.3 when loaded like this."""
    out: list = []
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)  # the engine thread's pool takes this size when it first runs

    def run() -> None:
        try:
            out.append(start_engine(names, loader(), config))
        except BaseException as exc:  # re-raised on the caller's thread
            out.append(exc)

    thread = threading.Thread(target=run, name="saker-load")
    thread.start()
    thread.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def start_engine(names: tuple[str, ...], loaded: LoadedModel, config: EngineConfig) -> EngineCore:
    model, tok = loaded.model, loaded.tokenizer
    runner = ModelRunner(model, tok, eos_ids(model, tok), tuple(loaded.adapters))
    info = ModelInfo(
        names, tuple(loaded.adapters), runner.context_length, runner.vocab_size, loaded.source, loaded.precision
    )
    warm_up(runner, info.context_length)
    core = EngineCore(
        runner,
        max_batch_rows=config.max_batch_rows,
        prefill_tokens=config.prefill_batch_tokens,
        prefill_chunk_tokens=config.prefill_chunk_tokens,
        kv_cache_tokens=config.kv_cache_tokens,
        prefix_cache_tokens=config.prefix_cache_tokens,
        max_running_requests=config.running_requests,
        max_queue=config.max_queue,
        queue_timeout=config.queue_timeout,
        speculative=config.speculative,
    )
    # the pool now: its default budget (90 % of the free GPU memory) is taken once a draft model holds its own
    core.kv_cache_tokens = core.batch.make_pool()
    core.info, core.load_seconds = info, loaded.load_seconds
    on_cuda = runner.input_device.type == "cuda"
    flat_on_cpu = not on_cuda and runner.flat_compiles()
    if flat_on_cpu and (config.compile if config.compile is not None else COMPILE_FLAT_BY_DEFAULT):
        compile_flat_step(runner, core)  # the CPU's kernel path: every step through one compiled graph
    elif config.compile if config.compile is not None else on_cuda:
        if on_cuda and runner.flat_compiles():  # the steps with prompt chunks: a CUDA graph per token bucket (first:
            compile_flat_step(runner, core, flat_sizes(config, info.context_length))  # the decode step reads it)
        compile_decode_step(runner, core, config.max_batch_rows, info.context_length)
    freeze_heap()
    core.start()
    log.info(
        "serving %s as %s from %s (loaded in %.1f s, context %d, %s)",
        names[0],
        ", ".join(names + info.adapters),
        loaded.source,
        loaded.load_seconds,
        info.context_length,
        loaded.precision,
    )
    return core


def freeze_heap() -> None:
    """Everything alive once the engine is loaded and warmed up (the model's modules and tensors, the tokenizer,
    the imported libraries: a few hundred thousand objects) moved out of the garbage collector's sight
    (``gc.freeze``, as vLLM does after its warm-up). Otherwise each full collection while serving walks all of them
    with the interpreter held: 200-270 ms pauses on the 2-core CPU with the tests' tiny model (part E's load), every
    few hundred steps, in the middle of some step. Frozen objects are still freed when their last reference goes;
    only cycles among them are never collected, and they are what lives as long as the engine. At exit they are
    handed back (``gc.unfreeze``), so that the interpreter's last collections free them as before (a library that
    counts its objects at exit, Triton's nanobind, otherwise prints "leaked" lines into the server's log)."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however many engines this process starts
    atexit.register(gc.unfreeze)
    log.debug("froze %d objects out of the garbage collector's sight", gc.get_freeze_count())


MAX_CAPTURED_TOKENS = 1024  # the largest flat step CUDA graphs are captured for (larger ones run eagerly)


def warm_up(runner: ModelRunner, context_length: int) -> None:
    """One short greedy generation before /health turns 200, so the first request is not the slow one."""
    bos = runner.tokenizer.bos_token_id
    ids = [bos if bos is not None else 0]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    collect(iter(SoloRun(runner, ids, params, max_length=context_length)), params)


def compile_flat_step(runner: ModelRunner, core: EngineCore, sizes: FlatSizes | None = None) -> None:
    """The flat step compiled (``ModelRunner.compile_flat``; on CUDA captured at ``sizes``) and checked against the
    eager forward on the engine's pool, before /health turns 200; the seconds it took are logged."""
    start = time.perf_counter()
    pool = core.batch.pool
    if runner.compile_flat(pool.keys, pool.values, sizes):
        captured = f", {len(sizes.buckets)} CUDA graphs up to {sizes.top} tokens" if sizes else ""
        log.info("compiled the flat step (%.1f s%s)", time.perf_counter() - start, captured)


def compile_decode_step(runner: ModelRunner, core: EngineCore, max_rows: int, context_length: int) -> None:
    """SAKER_COMPILE: compile the decode-only step and run it once per batch bucket (and window) on the engine's
    own pool, so that no request pays a compile or a CUDA graph capture."""
    import torch

    start = time.perf_counter()
    runner.compile_step()
    with torch.inference_mode():
        core.batch.warm_up(max_rows, context_length)
    log.info(
        "compiled the decode step for batches up to %d rows, windows up to %d positions (%.1f s)",
        max_rows,
        core.batch.capacity,
        time.perf_counter() - start,
    )


def flat_sizes(config: EngineConfig, context_length: int) -> FlatSizes:
    """What CUDA's compiled flat step is captured for: up to a step's token budget (the prompts' chunks beside the
    running rows' tokens), tables as wide as the context, logits for every running row plus a few prompts ending."""
    chunk = config.prefill_chunk_tokens or MAX_CAPTURED_TOKENS
    top = min(MAX_CAPTURED_TOKENS, max(config.prefill_batch_tokens, config.max_batch_rows + chunk))
    return FlatSizes(top=top, width=-(-context_length // BLOCK), logits=bucket(config.max_batch_rows + 8))
