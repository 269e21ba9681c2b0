"""``--profile``: py-spy on the gunicorn worker after parts A and C (never during their measurements), and where
the worker's time goes (``profile-A.txt``, ``profile-C.txt`` and their summary in bench.json)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from tooling.bench.client import Client
from tooling.bench.server import Server


def record(
    server: Server, client: Client, body: dict, reps: int, label: str, out_dir: Path, log: Callable[[str], None]
) -> dict:
    """py-spy on the gunicorn worker while ``reps`` requests run (after the measurements, never during)."""
    import shutil

    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        raise RuntimeError("py-spy is not installed (pip install -r requirements-bench.txt)")
    pids = server.worker_pids()
    if not pids:
        raise RuntimeError("no gunicorn worker found")
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / f"profile-{label}.txt"
    proc = subprocess.Popen(
        [
            py_spy,
            "record",
            "--pid",
            str(pids[0]),
            "--rate",
            "250",
            "--format",
            "raw",
            "--output",
            str(raw),
            "--nonblocking",
            "--threads",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    time.sleep(1.0)
    try:
        for _ in range(reps):
            client.complete(body)
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    if not raw.is_file():
        raise RuntimeError(f"py-spy wrote nothing: {err.decode(errors='replace')[-500:]}")
    result = summarize_profile(raw)
    result["requests"] = reps
    cats = ", ".join(f"{k} {v:.0%}" for k, v in result["categories"].items())
    log(f"profile {label}: {cats}")
    return result


def summarize_profile(raw: Path, top: int = 20) -> dict:
    """py-spy's collapsed stacks (``--threads``) -> where the worker's time goes: shares per thread and per
    category (model forward in torch modules / engine Python around it / HTTP and JSON / other), and the busiest
    lines of the thread that runs the model. Line shares inside the forward are indicative only: a sampled Python
    line stands for whatever native work it started (the torch profiler splits the forward by operator)."""
    threads: dict[str, int] = {}
    categories = {
        "model forward (torch modules)": 0,
        "engine Python (sampling, detokenize, stops, cache)": 0,
        "HTTP, Flask, JSON, protocol": 0,
        "other": 0,
    }
    stacks: list[tuple[str, list[str], int]] = []
    forward_by_thread: dict[str, int] = {}
    samples = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1] if frames[0].startswith("thread (") else "?"
        body = frames[1:] if frames[0].startswith("thread (") else frames
        threads[thread] = threads.get(thread, 0) + n
        samples += n
        stacks.append((thread, body, n))
        if any("Module._call_impl" in f for f in body):
            categories["model forward (torch modules)"] += n
            forward_by_thread[thread] = forward_by_thread.get(thread, 0) + n
        elif any("app/engine/" in f for f in body):
            categories["engine Python (sampling, detokenize, stops, cache)"] += n
        elif any(
            k in f
            for f in body
            for k in ("flask/", "werkzeug/", "gunicorn/", "app/api.py", "app/service.py", "app/protocol.py", "json/")
        ):
            categories["HTTP, Flask, JSON, protocol"] += n
        else:
            categories["other"] += n
    model_thread = max(forward_by_thread, key=forward_by_thread.get) if forward_by_thread else None
    inclusive: dict[str, int] = {}
    self_time: dict[str, int] = {}
    model_samples = 0
    for thread, body, n in stacks:
        if thread != model_thread or not body:
            continue
        model_samples += n
        for frame in set(body):
            inclusive[frame] = inclusive.get(frame, 0) + n
        self_time[body[-1]] = self_time.get(body[-1], 0) + n

    def ranked(table: dict[str, int], total: int) -> list[dict]:
        return (
            [{"frame": f, "share": round(c / total, 3)} for f, c in sorted(table.items(), key=lambda kv: -kv[1])[:top]]
            if total
            else []
        )

    return {
        "raw": raw.name,
        "samples": samples,
        "model_thread": model_thread,
        "threads": {k: round(v / samples, 3) for k, v in sorted(threads.items(), key=lambda kv: -kv[1])}
        if samples
        else {},
        "categories": {k: round(v / samples, 3) for k, v in categories.items()} if samples else {},
        "model_thread_inclusive": ranked(inclusive, model_samples),
        "model_thread_self": ranked(self_time, model_samples),
    }


def rows(results: dict) -> list[tuple[str, str, str, str, str]]:
    """The table's rows of the profiles that ran (PA, PC)."""
    out = []
    for label in ("A", "C"):
        prof = results.get(f"profile_{label}")
        if prof and prof.get("categories"):
            cats = prof["categories"]
            out.append(
                (
                    f"P{label}",
                    f"where the worker's time goes in {label} (py-spy)",
                    f"forward {cats['model forward (torch modules)']:.0%}",
                    f"engine Python {cats['engine Python (sampling, detokenize, stops, cache)']:.0%}, "
                    f"HTTP/JSON {cats['HTTP, Flask, JSON, protocol']:.0%}, other {cats['other']:.0%}, "
                    f"{prof['samples']} samples",
                    "",
                )
            )
    return out
