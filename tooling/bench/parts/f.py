"""F: the machine's own limits beside saker's decode steps (DESIGN.md, "The machine's own limits"). Peers move with
the CPU; the machine does not: one decoding row must read every weight byte once, so its step takes at least
weight bytes / memory bandwidth; 32 rows must do 2 x parameters x 32 multiply-adds, so their step takes at least
that / the matrix throughput of the served dtype. Measured in one run, side by side, in process, on the bench's
torch threads (the server's OMP_NUM_THREADS), in rounds; each round measures:

- the memory bandwidth: the best of ``f_reps`` ``x.sum()`` over a float32 tensor of ``f_bandwidth_mib`` (bytes
  read / s) and of ``dst.copy_(src)`` (bytes read + written / s); the higher of the two is the bandwidth (the
  lower floor, so the goal is judged strictly);
- the matrix throughput in the served dtype (float32 activations): the best of ``f_reps`` ``torch.mm`` of
  ``f_mm_size`` squared (2 m n k / s);
- saker's decode step on the embedded SmolLM2 as served (``LoadConfig()``: int4 linears from the GGUF's codes,
  the LM head int8, float32 activations, eager): ``app.engine.core.step.decode_step`` (the batch's one flat
  forward over the KV pool, the sampler, the rows kept; no speculative guesses, no scheduler, no output side) of
  a batch of 1 row and of 32 rows, greedy, ``f_prompt_tokens``-token prompts admitted first; after ``f_warmup``
  steps, the median of ``f_steps_1`` (1 row) or ``f_steps_32`` (32 rows) steps, or of those that fit in
  ``f_step_seconds`` (at least 5).

Weight bytes: every parameter and buffer of the model as loaded, each storage once (the int4 linears' packed codes
and their scales and zeros, the int8 LM head and its scales, the norms, the rotary tables), less the input
embedding table (a step reads one row of it per token; a head tied to it is counted as the head). Parameters:
``in_features x out_features`` of every linear, the LM head's included (no embedding, no attention scores). Goals:
each step <= 1.5 x its floor (``GOALS['F 1 row']``, ``GOALS['F 32 rows']``), read as the median over the rounds
of each round's step / floor. A round that other processes disturbed is replaced within ``f_budget``. When a goal
is missed, torch.profiler's operators by self CPU time over ``f_profile_steps`` steps of each batch say where the
rest goes. Not with ``--url``."""

from __future__ import annotations

import math
import statistics
import time
from typing import TYPE_CHECKING, Any

from tooling.bench.machine import cpu_flags
from tooling.bench.models import prompt_ids
from tooling.bench.plan import GOALS, check_goal
from tooling.bench.report import Row, met
from tooling.bench.stats import summary

if TYPE_CHECKING:
    from tooling.bench.runner import Bench

ROWS = (1, 32)  # the batches whose decode steps are measured: 1 row (bandwidth), 32 rows (matrix throughput)
GOAL_KEYS = {1: "F 1 row", 32: "F 32 rows"}
MIN_STEPS = 5  # timed steps per batch and round, whatever f_step_seconds says


# -- the arithmetic -----------------------------------------------------------------------------------------------
def bandwidth_floor_ms(weight_bytes: float, bytes_per_s: float) -> float:
    """The least a 1-row step can take: every weight byte read once at the machine's memory bandwidth."""
    return weight_bytes / bytes_per_s * 1000


def matmul_floor_ms(parameters: float, rows: int, flops_per_s: float) -> float:
    """The least a ``rows``-row step can take: 2 x parameters x rows floating-point operations (a multiply and an
    add per weight and row) at the machine's matrix throughput."""
    return 2 * parameters * rows / flops_per_s * 1000


def floors_ms(weight_bytes: float, parameters: float, bytes_per_s: float, flops_per_s: float) -> dict[int, float]:
    """Each measured batch's floor (ms): 1 row the bandwidth floor, 32 rows the matrix-throughput floor."""
    return {1: bandwidth_floor_ms(weight_bytes, bytes_per_s), 32: matmul_floor_ms(parameters, 32, flops_per_s)}


def ratios(step_ms: dict[int, float], floor_ms: dict[int, float]) -> dict[int, float]:
    """Each batch's step over its floor (1.0: the step runs at the machine's limit)."""
    return {rows: step_ms[rows] / floor_ms[rows] for rows in step_ms}


# -- what the model reads and computes ---------------------------------------------------------------------------
def weight_bytes(model) -> dict[str, Any]:
    """The bytes a decode step reads of the model: every parameter and buffer, each storage once, grouped by the
    module that holds it (the output head under "LM head"), less the input embedding table unless the head shares
    it (``left_out``: those bytes)."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    seen: set[int] = set()
    kinds: dict[str, int] = {}

    def count(module, kind: str) -> None:
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            key = tensor.untyped_storage().data_ptr()
            if key in seen or tensor.numel() == 0:
                continue
            seen.add(key)
            kinds[kind] = kinds.get(kind, 0) + tensor.numel() * tensor.element_size()

    if head is not None:
        count(head, "LM head")  # first: a head tied to the embedding is read whole every step
    left_out = 0
    if embedding is not None:
        for tensor in [*embedding.parameters(recurse=False), *embedding.buffers(recurse=False)]:
            if tensor.untyped_storage().data_ptr() not in seen:
                seen.add(tensor.untyped_storage().data_ptr())
                left_out += tensor.numel() * tensor.element_size()
    for module in model.modules():
        if module is not head and module is not embedding:
            count(module, type(module).__name__)
    return {"total": sum(kinds.values()), "by_kind": dict(sorted(kinds.items())), "left_out": left_out}


def matmul_parameters(model) -> int:
    """``in_features x out_features`` of every linear (``nn.Linear``, the quantized ``Int4Linear``/``Int8Linear``,
    GPT-2's ``Conv1D``), the LM head's included: the weights a row multiplies once per step."""
    total = 0
    for module in model.modules():
        shape = (getattr(module, "in_features", None), getattr(module, "out_features", None))
        if not all(isinstance(n, int) for n in shape):
            shape = (getattr(module, "nx", None), getattr(module, "nf", None))  # transformers' Conv1D
        if all(isinstance(n, int) for n in shape):
            total += shape[0] * shape[1]
    return total


# -- the machine ------------------------------------------------------------------------------------------------
def _best_s(fn, reps: int) -> float:
    fn()  # first touch (page faults, the thread pool's start) not timed
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def memory_bandwidth(mib: int, reps: int) -> dict[str, float]:
    """GB/s of a reduction (``x.sum()``: bytes read) and of a copy (``dst.copy_(src)``: bytes read + written) over
    ``mib`` MiB of float32, each the best of ``reps``; ``gbps`` the higher."""
    import torch

    size = mib * 2**20
    src = torch.ones(size // 4, dtype=torch.float32)
    read = size / _best_s(src.sum, reps) / 1e9
    dst = torch.empty_like(src)
    copied = 2 * size / _best_s(lambda: dst.copy_(src), reps) / 1e9
    return {"sum_gbps": round(read, 2), "copy_gbps": round(copied, 2), "gbps": round(max(read, copied), 2)}


def matmul_throughput(n: int, reps: int, dtype) -> float:
    """GFLOP/s of ``torch.mm`` of two ``n`` x ``n`` matrices in ``dtype``, the best of ``reps``."""
    import torch

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    return round(2 * n**3 / _best_s(lambda: torch.mm(a, b), reps) / 1e9, 2)


# -- saker's decode step ----------------------------------------------------------------------------------------
def decoding_batch(runner, prompts: list[list[int]], steps: int):
    """A batch of its own (``BlockBatch`` over a KV pool sized for it) with each prompt admitted as a greedy row
    that ignores EOS and runs at least ``steps`` more tokens: what the engine's running batch is mid-decode."""
    import torch

    from app.engine.core.batches import BlockBatch
    from app.engine.core.sequence import RequestGroup
    from app.engine.core.solo import admit
    from app.engine.params import SamplingParams

    longest = max(len(p) for p in prompts)
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    with torch.inference_mode():
        batch = BlockBatch(runner, kv_cache_tokens=len(prompts) * (longest + steps + 64))
        for ids in prompts:
            admit(batch, RequestGroup(runner, ids, params, max_length=runner.context_length))
    if sum(group.rows for group in batch.groups) != len(prompts):
        raise RuntimeError(f"F: {len(prompts)} prompts admitted as {sum(g.rows for g in batch.groups)} rows")
    return batch


def step_ms(runner, prompts: list[list[int]], warmup: int, steps: int, seconds: float = math.inf) -> list[float]:
    """Milliseconds of each of ``steps`` decode steps (after ``warmup``) of a batch of ``len(prompts)`` rows; no
    more steps once the timed ones have taken ``seconds`` (at least ``MIN_STEPS`` of them: a busy machine's steps
    can be a hundred times a quiet one's)."""
    import torch

    from app.engine.core.step import decode_step

    batch = decoding_batch(runner, prompts, warmup + steps)
    out = []
    with torch.inference_mode():
        for _ in range(warmup + steps):
            start = time.perf_counter()
            decode_step(batch)
            out.append((time.perf_counter() - start) * 1000)
            timed = out[warmup:]
            if len(timed) >= MIN_STEPS and sum(timed) / 1000 > seconds:
                break
    if sum(group.rows for group in batch.groups) != len(prompts):
        raise RuntimeError("F: a row left the batch while its steps were timed")
    return out[warmup:]


def profile_steps(runner, prompts: list[list[int]], steps: int, top: int = 12) -> dict[str, Any]:
    """torch.profiler over ``steps`` decode steps of a batch of ``len(prompts)`` rows: the operators with the most
    self CPU time (ms per step, share of the profiled time, calls per step). The profiler's own overhead makes
    small operators look dearer than they are; the order is what counts."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from app.engine.core.step import decode_step

    batch = decoding_batch(runner, prompts, steps + 2)
    with torch.inference_mode():
        decode_step(batch)
        decode_step(batch)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                decode_step(batch)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return {
        "steps": steps,
        "profiled_ms_per_step": round(total / 1000 / steps, 3),
        "top": [
            {
                "op": e.key,
                "self_ms_per_step": round(e.self_cpu_time_total / 1000 / steps, 3),
                "share": round(e.self_cpu_time_total / total, 3),
                "calls_per_step": round(e.count / steps, 1),
            }
            for e in events[:top]
        ],
    }


# -- the part -----------------------------------------------------------------------------------------------------
def run(bench: Bench) -> dict:
    import torch

    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.model.runner import ModelRunner, eos_ids
    from tooling.bench.parts.s import smol_path

    plan = bench.plan
    smol_path(bench)  # converted once into the bench's cache, recorded in the report's models
    bench.settle()
    # as served: the embedded default (int4 from the GGUF's codes, the LM head int8), float32, on the CPU
    loaded = load_model(LoadConfig(cache_dir=str(bench.cache_dir), device="cpu"))
    model, tok = loaded.model, loaded.tokenizer
    runner = ModelRunner(model, tok, eos_ids(model, tok), tuple(loaded.adapters))
    counted, parameters = weight_bytes(model), matmul_parameters(model)
    base = prompt_ids(tok, plan.f_prompt_tokens)
    prompts = {rows: [base[i % len(base) :] + base[: i % len(base)] for i in range(rows)] for rows in ROWS}
    dtype = model.dtype  # the activations' (float32 as served on the CPU)
    threads, flags = torch.get_num_threads(), cpu_flags()
    bench.log(
        f"  F: {torch.backends.cpu.get_cpu_capability()}, flags {' '.join(flags) or '-'}; {threads} torch threads; "
        f"{loaded.precision}; weights read per step {counted['total'] / 1e6:.1f} MB, "
        f"{parameters / 1e6:.1f} M parameters in matmuls"
    )
    step_counts = {1: plan.f_steps_1, 32: plan.f_steps_32}

    def one_round(i: int) -> dict:
        bandwidth = memory_bandwidth(plan.f_bandwidth_mib, plan.f_reps)
        gflops = matmul_throughput(plan.f_mm_size, plan.f_reps, dtype)
        times = {
            rows: step_ms(runner, prompts[rows], plan.f_warmup, step_counts[rows], plan.f_step_seconds) for rows in ROWS
        }
        steps = {rows: statistics.median(t) for rows, t in times.items()}
        floors = floors_ms(counted["total"], parameters, bandwidth["gbps"] * 1e9, gflops * 1e9)
        out = {
            "bandwidth": bandwidth,
            "matmul_gflops": gflops,
            "step_ms": {str(rows): summary(t, 3) for rows, t in times.items()},
            "floor_ms": {str(rows): round(f, 3) for rows, f in floors.items()},
            "ratio": {str(rows): round(r, 3) for rows, r in ratios(steps, floors).items()},
        }
        bench.log(
            f"  F round {i + 1}: {bandwidth['gbps']:g} GB/s (sum {bandwidth['sum_gbps']:g}, copy "
            f"{bandwidth['copy_gbps']:g}), {gflops:g} GFLOP/s; 1 row {steps[1]:.2f} ms / {floors[1]:.2f} = "
            f"{steps[1] / floors[1]:.2f}, 32 rows {steps[32]:.2f} ms / {floors[32]:.2f} = {steps[32] / floors[32]:.2f}"
        )
        return out

    runs = bench.repeat(one_round, plan.f_rounds, plan.f_rounds, plan.f_budget)
    used, chosen = bench.select(runs)

    def med(get) -> float:
        return round(statistics.median(get(r) for r in used), 3)

    result: dict[str, Any] = {
        "model": {"precision": loaded.precision, "source": loaded.source, "dtype": str(dtype).replace("torch.", "")},
        "weight_bytes": counted,
        "matmul_parameters": parameters,
        "threads": threads,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": flags,
        "prompt_tokens": plan.f_prompt_tokens,
        "rounds": [r for r, _ in runs],
        "chosen": chosen,
        "bandwidth_gbps": med(lambda r: r["bandwidth"]["gbps"]),
        "matmul_gflops": med(lambda r: r["matmul_gflops"]),
        "step_ms": {str(rows): med(lambda r, k=str(rows): r["step_ms"][k]["median"]) for rows in ROWS},
        "floor_ms": {str(rows): med(lambda r, k=str(rows): r["floor_ms"][k]) for rows in ROWS},
        "ratio": {str(rows): med(lambda r, k=str(rows): r["ratio"][k]) for rows in ROWS},
        "goal": {str(rows): list(GOALS[GOAL_KEYS[rows]]) for rows in ROWS},
    }
    result["met"] = {str(rows): check_goal(GOAL_KEYS[rows], result["ratio"][str(rows)]) for rows in ROWS}
    if any(m is False for m in result["met"].values()) and plan.f_profile_steps:
        result["profile"] = {str(rows): profile_steps(runner, prompts[rows], plan.f_profile_steps) for rows in ROWS}
        for rows, prof in result["profile"].items():
            ops = ", ".join(f"{t['op']} {t['self_ms_per_step']:g} ms" for t in prof["top"][:6])
            bench.log(f"  F profile, {rows} row(s), self CPU per step ({prof['profiled_ms_per_step']:g} ms): {ops}")
    return result


def rows(result: dict) -> list[Row]:
    weights = result["weight_bytes"]["total"] / 1e6
    out: list[Row] = []
    for rows_, label, detail in (
        (
            "1",
            "1-row decode step / (weight bytes / memory bandwidth)",
            f"{weights:.1f} MB / {result['bandwidth_gbps']:g} GB/s",
        ),
        (
            "32",
            "32-row decode step / (2 x parameters x 32 / matmul throughput)",
            f"2 x {result['matmul_parameters'] / 1e6:.1f} M x 32 / {result['matmul_gflops']:g} GFLOP/s",
        ),
    ):
        ratio, verdict = result["ratio"][rows_], result["met"][rows_]
        op, goal = result["goal"][rows_]
        out.append(
            (
                "F",
                label,
                f"{ratio:g}",
                f"step {result['step_ms'][rows_]:g} ms, floor {result['floor_ms'][rows_]:g} ms ({detail})",
                f"{op} {goal:g}: {met(verdict)}",
            )
        )
    out.append(
        (
            "F",
            f"the machine: memory GB/s; float32 mm GFLOP/s ({result['threads']} threads)",
            f"{result['bandwidth_gbps']:g}; {result['matmul_gflops']:g}",
            f"{result['cpu_capability']}, flags {' '.join(result['cpu_flags']) or '-'}",
            "",
        )
    )
    return out
