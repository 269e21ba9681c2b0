"""The flat step eager against compiled on the CPU, in-process (issue 36 item 1; no server).

What it measures, for one model and one inductor variant per run (inductor's settings are per process):

- the compile: seconds to compile and check the graph (``ModelRunner.compile_flat``: the warm-up steps against the
  eager forward, bit for bit), with a fresh inductor cache (``--inductor-cache`` unset) or a kept one (a restart);
- milliseconds per step at 1, 8 and 32 decode rows (rows at lengths 100-300) and for a 256-token prompt chunk, eager
  and compiled side by side, their repetitions alternating (which goes first alternates too) so that the load other
  work puts on the machine hits both alike: the median, the spread (min-max) and the process CPU time per step.
  Decode-only steps run eagerly as the server runs them today (``rows_step``, the rows as the forward's batch) and as
  a flat step (``flat_step``); compiled, both are the one graph;
- graphs and recompiles over steps of 1..64 tokens: decode rows alone, a chunk alone, rows with a chunk (mixed),
  each compiled step's logits against the eager step's (bit for bit, and the largest logprob difference);
- ``--profile``: the top operators by self CPU time (torch.profiler), eager and compiled, at 1 and 32 rows.

Models: ``int4`` (the embedded default as served on the CPU: its GGUF's 4-bit codes, the int8 LM head, the
fixed-order attention kernel; the graph is ``ModelRunner.flat_forward``), ``float32`` and ``bfloat16``
(``SAKER_QUANTIZE=none``: attention by SDPA over each chunk's blocks, so the compiled function is ``flat_step``
itself with ``dynamic=True``: what compiling the forward as it is gives, one graph per step shape kind).

    .venv/bin/python scripts/compile_flat_step.py --model int4 --variant default --json /tmp/int4.json

Variants: ``default`` (inductor's defaults, ``max_autotune`` off), ``freezing`` (``freezing=True``: weights as
constants, folded and pre-packed where inductor knows how), ``cpp_wrapper`` (the graph's calls from C++, not a
Python wrapper). The figures and what they mean are in docs/performance.md ("The compiled flat step on the CPU").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("int4", "float32", "bfloat16"), default="int4")
    parser.add_argument("--variant", choices=("default", "freezing", "cpp_wrapper"), default="default")
    parser.add_argument("--reps", type=int, default=20, help="repetitions of each side per case")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cases", default="1,8,32,c256", help="decode rows, or cN: a prompt chunk of N tokens")
    parser.add_argument("--recompiles", action="store_true", help="steps of 1..64 tokens: graphs, recompiles, bits")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--inductor-cache", help="inductor's cache folder (unset: a fresh one, a cold compile)")
    parser.add_argument("--cache-dir", default=str(ROOT / ".cache" / "saker"), help="saker's (the converted model)")
    parser.add_argument("--json", help="write every figure here")
    return parser.parse_args()


def main() -> None:
    args = parse()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.inductor_cache or tempfile.mkdtemp(prefix="inductor-")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import numpy as np
    import torch
    import torch._inductor.config as inductor

    torch.set_num_threads(args.threads)
    inductor.max_autotune = False
    if args.variant == "freezing":
        inductor.freezing = True
    elif args.variant == "cpp_wrapper":
        inductor.cpp_wrapper = True

    from app.engine.model.kv_cache import BLOCK, KVPool
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.model.runner import ModelRunner, eos_ids

    config = {"int4": {}, "float32": {"quantize": "none", "dtype": "float32"}}.get(
        args.model, {"quantize": "none", "dtype": "bfloat16"}
    )
    loaded = load_model(LoadConfig(cache_dir=args.cache_dir, device="cpu", **config))
    model = loaded.model
    runner = ModelRunner(model, loaded.tokenizer, eos_ids(model, loaded.tokenizer))
    blocks = 32 * (300 // BLOCK + 1) + 256 // BLOCK + 64  # 32 rows of up to 300 positions, a 256-token chunk
    pool = KVPool(runner.probe_cache(), blocks, dtype=runner.kv_dtype)
    pool.touch(blocks)
    rng = np.random.default_rng(0)
    result: dict = {
        "model": args.model,
        "precision": loaded.precision,
        "variant": args.variant,
        "threads": args.threads,
        "machine": machine(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    print(f"{args.model} ({loaded.precision}), variant {args.variant}, {args.threads} threads", flush=True)

    from torch._dynamo.utils import counters

    # -- compile ---------------------------------------------------------------------------------------------------
    start = time.perf_counter()
    if runner.flat_compiles():
        graph = "ModelRunner.flat_forward (tensors only)"
        if not runner.compile_flat(pool.keys, pool.values):
            raise SystemExit("the compiled flat step did not give the eager forward's numbers (see the log)")
        compiled_flat = runner.compiled_flat
        runner.compiled_flat = None

        def compiled(step):
            runner.compiled_flat = compiled_flat
            try:
                return run_step(runner, step, "flat")
            finally:
                runner.compiled_flat = None

    else:
        graph = "ModelRunner.flat_step (FlatStep in, dynamic=True)"
        plain = torch.compile(runner.flat_step, dynamic=True, fullgraph=True)

        def compiled(step):
            tokens, positions, make_flat, logits_at, _ = step
            return plain(tokens, positions, make_flat(), logits_at)

        with torch.inference_mode():  # the first two shapes: static, then dynamic
            compiled(make_step(runner, pool, rng, 3, 0))
            compiled(make_step(runner, pool, rng, 5, 0))
    result["graph"] = graph
    result["compile_s"] = round(time.perf_counter() - start, 1)
    result["graphs_after_compile"] = counters["stats"]["unique_graphs"]
    print(f"graph: {graph}; compiled and checked in {result['compile_s']} s", flush=True)

    # -- per step --------------------------------------------------------------------------------------------------
    cases = []
    for case in args.cases.split(","):
        rows, chunk = (0, int(case[1:])) if case.startswith("c") else (int(case), 0)
        cases.append((case, rows, chunk))
    result["steps"] = {}
    with torch.inference_mode():
        for name, rows, chunk in cases:
            step = make_step(runner, pool, rng, rows, chunk)
            sides = {"eager flat": lambda s=step: run_step(runner, s, "flat"), "compiled": lambda s=step: compiled(s)}
            if rows and not chunk:
                sides["eager rows"] = lambda s=step: run_step(runner, s, "rows")
            for fn in sides.values():  # once each, not timed
                fn()
            wall = {side: [] for side in sides}
            cpu = {side: [] for side in sides}
            order = list(sides)
            for rep in range(args.reps):
                for side in order if rep % 2 == 0 else order[::-1]:
                    t0, c0 = time.perf_counter(), time.process_time()
                    sides[side]()
                    wall[side].append(1e3 * (time.perf_counter() - t0))
                    cpu[side].append(1e3 * (time.process_time() - c0))
            figures = {
                side: {
                    "median_ms": round(statistics.median(wall[side]), 2),
                    "min_ms": round(min(wall[side]), 2),
                    "max_ms": round(max(wall[side]), 2),
                    "cpu_median_ms": round(statistics.median(cpu[side]), 2),
                    "wall_ms": [round(x, 2) for x in wall[side]],
                }
                for side in sides
            }
            eager_best = min(figures[s]["median_ms"] for s in sides if s.startswith("eager"))
            figures["compiled/eager"] = round(figures["compiled"]["median_ms"] / eager_best, 3)
            result["steps"][name] = figures
            line = "  ".join(
                f"{side} {f['median_ms']:.2f} ms [{f['min_ms']:.2f}-{f['max_ms']:.2f}] cpu {f['cpu_median_ms']:.2f}"
                for side, f in figures.items()
                if isinstance(f, dict)
            )
            print(f"{name:>5}: {line}  compiled/best eager {figures['compiled/eager']}", flush=True)

        # -- graphs and recompiles over 1..64 tokens -----------------------------------------------------------
        if args.recompiles:
            before = dict(counters["stats"])
            recompiles_before = sum(counters["recompiles"].values())
            worst, unequal, kinds = 0.0, 0, {}
            for tokens_count in range(1, 65):
                for kind, rows, chunk in (
                    ("rows", tokens_count, 0),
                    ("chunk", 0, tokens_count),
                    ("mixed", max(1, tokens_count // 3), tokens_count - max(1, tokens_count // 3)),
                ):
                    step = make_step(runner, pool, rng, rows, chunk, lengths=(5, 60))
                    want = run_step(runner, step, "flat")
                    got = compiled(step)
                    if not torch.equal(want, got):
                        unequal += 1
                        diff = (want.log_softmax(-1) - got.log_softmax(-1)).abs().max().item()
                        worst = max(worst, diff)
                    kinds[kind] = kinds.get(kind, 0) + 1
            result["recompiles"] = {
                "steps": kinds,
                "new_graphs": counters["stats"]["unique_graphs"] - before.get("unique_graphs", 0),
                "recompiles": sum(counters["recompiles"].values()) - recompiles_before,
                "graph_breaks": sum(counters["graph_break"].values()),
                "steps_not_bit_equal": unequal,
                "largest_logprob_difference": worst,
            }
            print(f"1..64 tokens: {result['recompiles']}", flush=True)

        if args.profile:
            result["profile"] = {}
            for rows in (1, 32):
                step = make_step(runner, pool, rng, rows, 0)
                sides = (
                    ("eager", lambda s=step: run_step(runner, s, "rows")),
                    ("compiled", lambda s=step: compiled(s)),
                )
                for side, fn in sides:
                    table = profile(fn)
                    result["profile"][f"{side} {rows} rows"] = table
                    print(f"--- {side}, {rows} rows: top operators by self CPU time (10 steps)\n{table}", flush=True)

    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def make_step(runner, pool, rng, rows: int, chunk: int, lengths: tuple[int, int] = (100, 300)):
    """A step as the batch builds it (``BlockBatch.forward_with_chunks``): ``rows`` decode rows at ``lengths``,
    each over blocks of its own, then a chunk of ``chunk`` prompt tokens at positions 0.. of a prompt of its own (its
    last token's logits wanted). Returns (tokens, positions, a maker of the step's FlatStep, logits_at, the rows'
    (write, gather, positions) for ``rows_step``)."""
    import numpy as np
    import torch

    from app.engine.model.attention import FlatStep
    from app.engine.model.kv_cache import BLOCK

    lengths = rng.integers(*lengths, size=rows)
    width = -(-(int(lengths.max()) + 1) // BLOCK) if rows else 0
    gather = np.zeros((rows, width), dtype=np.int64)
    next_block = 1
    for row, length in enumerate(lengths):
        count = int(length) // BLOCK + 1
        gather[row, :count] = np.arange(next_block, next_block + count)
        next_block += count
    positions = np.concatenate([lengths, np.arange(chunk)]).astype(np.int64)
    write = [gather[r, lengths[r] // BLOCK] * BLOCK + lengths[r] % BLOCK for r in range(rows)]
    chunks = ()
    if chunk:
        blocks = np.arange(next_block, next_block + -(-chunk // BLOCK))
        at = np.arange(chunk)
        write += list(blocks[at // BLOCK] * BLOCK + at % BLOCK)
        chunks = ((torch.from_numpy(blocks), 0, chunk),)
    tokens = torch.from_numpy(rng.integers(10, 40000, size=rows + chunk))
    positions = torch.from_numpy(positions)
    write = torch.tensor(write, dtype=torch.long)
    logits_at = torch.tensor(list(range(rows)) + ([rows + chunk - 1] if chunk else []), dtype=torch.long)
    row_gather = torch.from_numpy(gather) if rows else None
    row_positions = positions[:rows] if rows else None
    mask = None
    if rows:
        mask = (torch.arange(width * BLOCK).view(1, -1) <= row_positions.view(-1, 1)).view(rows, 1, 1, -1)

    def make_flat():
        return FlatStep(pool.keys, pool.values, write, rows, row_gather, mask, row_positions, chunks)

    return tokens, positions, make_flat, logits_at, (write[:rows], row_gather, row_positions, pool)


def run_step(runner, step, how: str):
    """The step eagerly as the server runs it: ``flat`` (``flat_step``), or ``rows`` (``rows_step``, decode rows
    only: the rows as the forward's batch)."""
    tokens, positions, make_flat, logits_at, (write, gather, row_positions, pool) = step
    if how == "rows":
        return runner.rows_step(tokens, row_positions, write, gather, pool.keys, pool.values)
    return runner.flat_step(tokens, positions, make_flat(), logits_at)


def profile(fn, steps: int = 10) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    fn()
    with profiler(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def machine() -> dict:
    import torch

    model = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?"
    )
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "load_average_at_start": os.getloadavg(),
    }


if __name__ == "__main__":
    main()
