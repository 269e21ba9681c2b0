"""K: saker against llama.cpp's server (llama-server) on the same model, the embedded SmolLM2-135M-Instruct GGUF
(Q4_1), on the same machine, one server at a time: closed loops of 1, 8 and 32 clients sending the same completion
prompt for 128 greedy tokens with ``ignore_eos``. At 1 client the requests are streamed and the figure is the
decode ms/token each request saw ((last token - first token) / (tokens - 1), from the client); at every level,
tokens/s = completion tokens / the loop's wall time (non-streamed beyond 1 client). Goals: at 1 client saker's
ms/token <= llama.cpp's; at 8 and 32 clients saker's tokens/s >= 1.5 x llama.cpp's. Beside them, each server's
peak resident memory (the RSS of its process tree, sampled while it serves). saker serves what it serves by
default (the GGUF converted to a float32 checkpoint); llama.cpp runs the GGUF as it is. llama-server is built
once by ``scripts/build-llama-server.sh`` into ``.cache/llama.cpp/bin/llama-server``; without it the part is
skipped with one line. Not with ``--url``."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from tooling.bench.client import Client, Reply, closed_loop
from tooling.bench.models import PROMPT_TEXT
from tooling.bench.plan import GOALS, ROOT, check_goal
from tooling.bench.report import Row, met
from tooling.bench.server import batch_env, free_port
from tooling.bench.stats import latency_summary, summary
from tooling.processes import stop_process

if TYPE_CHECKING:
    from tooling.bench.runner import Bench

BUILD_SCRIPT = "scripts/build-llama-server.sh"
SKIP_LINE = f"part K skipped: build llama.cpp's server with {BUILD_SCRIPT}"
LLAMA = "llama.cpp"
SAKER = "saker"
SIDES = (LLAMA, SAKER)  # measured in this order, one server at a time


def llama_binary() -> Path:
    """Where the build script puts llama-server (``BENCH_LLAMA_DIR`` moves it, as for the script)."""
    base = os.environ.get("BENCH_LLAMA_DIR") or str(ROOT / ".cache" / "llama.cpp")
    return Path(base).expanduser() / "bin" / "llama-server"


def skip_line(binary: Path) -> str | None:
    """The one line K prints instead of running when llama-server is not built (None when it is there)."""
    if binary.is_file() and os.access(binary, os.X_OK):
        return None
    return SKIP_LINE


def goal_key(clients: int) -> str:
    return f"K {clients} client" + ("s" if clients > 1 else "")


def compare(levels: dict[str, list[dict]]) -> list[dict]:
    """saker against llama.cpp per level: tokens/s and ms/token side by side, their ratios (saker / llama.cpp) and
    the goal of the level: at 1 client on the ms/token ratio (<= 1), beyond on the tokens/s ratio (>= 1.5).
    ``levels[side]`` is that side's list of levels, each with ``clients``, ``tokens_per_s`` and ``ms_per_token``
    (summaries with a ``median``)."""
    by_clients = {side: {lv["clients"]: lv for lv in levels.get(side, [])} for side in SIDES}
    out = []
    for clients in sorted(set(by_clients[LLAMA]) & set(by_clients[SAKER])):
        row: dict[str, Any] = {"clients": clients}
        for measure in ("tokens_per_s", "ms_per_token"):
            figures = {side: (by_clients[side][clients].get(measure) or {}).get("median") for side in SIDES}
            row[measure] = figures
            ratio = figures[SAKER] / figures[LLAMA] if figures[SAKER] and figures[LLAMA] else None
            row[f"{measure}_ratio"] = round(ratio, 3) if ratio is not None else None
        key = goal_key(clients)
        measure = "ms_per_token" if clients == 1 else "tokens_per_s"
        if key in GOALS:
            op, value = GOALS[key]
            row["goal"] = {"measure": f"{measure}_ratio", "op": op, "value": value}
            row["met"] = check_goal(key, row[f"{measure}_ratio"])
        out.append(row)
    return out


# -- the process trees' resident memory ------------------------------------------------------------------------------
def tree_rss(pid: int) -> int:
    """Bytes resident in process ``pid`` and all its descendants now (psutil when installed, else /proc)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        total = 0
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                total += proc.memory_info().rss
        return total
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    break
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{p}/task").iterdir():
                with contextlib.suppress(OSError, ValueError):
                    todo += [int(c) for c in (task / "children").read_text().split()]
    return total


class RssWatch:
    """Samples a process tree's RSS every ``interval`` seconds on a thread of its own: the idle figure when it
    starts (the server ready, no request yet) and the peak until ``stop``."""

    def __init__(self, pid: int, interval: float = 0.2):
        self.pid = pid
        self.interval = interval
        self.idle = tree_rss(pid)
        self.peak = self.idle
        self.samples = 1
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-k-rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            self.peak = max(self.peak, tree_rss(self.pid))
            self.samples += 1

    def stop(self) -> dict:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, tree_rss(self.pid))
        mib = 1024 * 1024
        return {"idle_mib": round(self.idle / mib, 1), "peak_mib": round(self.peak / mib, 1), "samples": self.samples}


# -- llama.cpp's server -----------------------------------------------------------------------------------------------
class LlamaServer:
    """llama-server on 127.0.0.1 with the GGUF, in a process group of its own (stopped with it)."""

    def __init__(self, binary: Path, gguf: Path, alias: str, threads: int, slots: int, ctx: int, log_dir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [
            str(binary),
            "-m",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-a",
            alias,
            "-np",
            str(slots),  # parallel slots: every client has one
            "-c",
            str(ctx),  # split among the slots: each holds the prompt and max_tokens
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "--cache-ram",
            "0",  # no host-memory prompt cache (saker's prefix cache is off too)
            "--no-webui",
        ]
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"llama-server-{self.port}.log"
        self.log = open(self.log_path, "w+")
        self.proc = subprocess.Popen(
            self.command, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )

    def wait_ready(self, timeout: float = 180) -> None:
        """Until /health answers 200 (503 while the model loads)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {self.proc.returncode}:\n{self.output()[-3000:]}")
            with contextlib.suppress(OSError):
                with socket.create_connection(("127.0.0.1", self.port), timeout=2) as sock:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    if sock.recv(64).startswith(b"HTTP/1.1 200"):
                        return
            time.sleep(0.2)
        raise TimeoutError(f"llama-server not ready after {timeout:.0f} s:\n{self.output()[-3000:]}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30) -> None:
        stop_process(self.proc, signal.SIGTERM, timeout)
        if not self.log.closed:
            self.log.close()


def llama_version(binary: Path) -> str:
    """``llama-server --version``'s line (version and commit), or what went wrong."""
    try:
        proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({type(exc).__name__})"
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("version")]
    return lines[0].strip() if lines else "unknown"


def slot_context(prompt: str, max_tokens: int) -> int:
    """Positions per llama.cpp slot: the prompt (over-estimated at a token per 3 characters) and ``max_tokens``,
    rounded up to 64."""
    need = len(prompt) // 3 + max_tokens + 16
    return 64 * math.ceil(need / 64)


# -- the measurement --------------------------------------------------------------------------------------------------
def _decode_ms_per_token(reply: Reply) -> float | None:
    """A streamed reply's decode time per token as the client saw it: first token to the end, per later token."""
    if reply.ttft_s is None or reply.tokens < 2:
        return None
    return (reply.e2e_s - reply.ttft_s) * 1000 / (reply.tokens - 1)


def measure(bench: Bench, client: Client, make_body: Callable[[int, bool], dict], side: str) -> list[dict]:
    """Every level of one server: a warm-up, then the rounds of each level (closed loops; a round disturbed by
    other processes is replaced within ``k_budget``)."""
    plan = bench.plan
    top = max(plan.k_levels)
    closed_loop(client, lambda i, j: make_body(8, False), top, 1)  # threads, slots, the batch path
    closed_loop(client, lambda i, j: make_body(8, True), 1, 1)
    levels = []
    for clients in plan.k_levels:
        stream = clients == 1
        per_client = plan.k_single_requests if clients == 1 else plan.k_per_client

        def one(rep: int, clients: int = clients, per_client: int = per_client, stream: bool = stream) -> dict:
            replies, wall = closed_loop(client, lambda i, j: make_body(plan.k_tokens, stream), clients, per_client)
            bench.settle()
            return {
                "rate": sum(r.tokens for r in replies) / wall,
                "tokens": [r.tokens for r in replies],
                "prompt_tokens": [r.prompt_tokens for r in replies],
                "decode": [d for d in map(_decode_ms_per_token, replies) if d is not None],
                "e2e_per_token": [r.e2e_s * 1000 / r.tokens for r in replies if r.tokens],
                "ttft": [r.ttft_s * 1000 for r in replies if r.ttft_s is not None],
                "lat": [r.e2e_s * 1000 for r in replies],
                "rejected": sum(r.rejected for r in replies),
            }

        used, selection = bench.select(bench.repeat(one, plan.k_rounds, plan.k_rounds, plan.k_budget))
        tokens = [t for u in used for t in u["tokens"]]
        prompt = sorted({p for u in used for p in u["prompt_tokens"] if p is not None})
        level: dict[str, Any] = {
            "clients": clients,
            "streamed": stream,
            "requests_per_round": clients * per_client,
            "selection": selection,
            "tokens_per_s": summary([u["rate"] for u in used], 2),
            # at 1 client the decode time per token of each (streamed) request; beyond, the request's whole time
            # per token (prefill and waiting included): the clients' view under load
            "ms_per_token": summary([d for u in used for d in (u["decode"] if stream else u["e2e_per_token"])]),
            "ms_per_token_kind": "decode (streamed, client side)" if stream else "request time / tokens",
            "e2e_ms_per_token": summary([x for u in used for x in u["e2e_per_token"]]),
            "latency_ms": latency_summary([x for u in used for x in u["lat"]]),
            "completion_tokens": {"min": min(tokens), "max": max(tokens), "requests": len(tokens)},
            "prompt_tokens": prompt,
            "rejected": sum(u["rejected"] for u in used),
        }
        if stream:
            level["ttft_ms"] = summary([x for u in used for x in u["ttft"]])
        bench.log(
            f"  K {side}, {clients} client(s): {level['tokens_per_s']['median']:g} tok/s, "
            f"{level['ms_per_token']['median']:g} ms/token ({level['ms_per_token_kind']})"
        )
        levels.append(level)
    return levels


def run(bench: Bench) -> dict | None:
    """llama-server first, then saker, each started, measured at every level and stopped before the other starts;
    then the comparison."""
    from tooling.bench.parts.s import SMOL_NAME, smol_path
    from app.engine.model.loader import embedded_gguf_path

    plan = bench.plan
    binary = llama_binary()
    line = skip_line(binary)
    if line is not None:
        bench.log(line)
        return {"skipped": line, "binary": str(binary)}
    gguf = embedded_gguf_path()
    slots = max(plan.k_levels)
    per_slot = slot_context(PROMPT_TEXT, plan.k_tokens)
    result: dict[str, Any] = {
        "model": SMOL_NAME,
        "gguf": str(gguf),
        "gguf_bytes": gguf.stat().st_size,
        "prompt": PROMPT_TEXT,
        "max_tokens": plan.k_tokens,
        "request": {"temperature": 0, "ignore_eos": not bench.args.no_ignore_eos},
        "llama_cpp_request_extra": {"cache_prompt": False},  # full prefills, as saker's (prefix cache off)
        "levels": list(plan.k_levels),
        "order": list(SIDES),
        "servers": {},
    }

    def body(name: str, extra: dict) -> Callable[[int, bool], dict]:
        def make(max_tokens: int, stream: bool) -> dict:
            out = {"model": name, "prompt": PROMPT_TEXT, "max_tokens": max_tokens, "temperature": 0, **extra}
            if not bench.args.no_ignore_eos:
                out["ignore_eos"] = True
            if stream:
                out["stream"] = True
                out["stream_options"] = {"include_usage": True}
            return out

        return make

    # llama.cpp's server: the GGUF as it is, a slot per client, prompts not cached between requests
    llama = LlamaServer(
        binary, gguf, SMOL_NAME, bench.threads, slots, slots * per_slot, bench.cache_dir / "logs" / "llama.cpp"
    )
    start = time.perf_counter()
    try:
        bench.log(f"starting llama-server: {' '.join(llama.command)}")
        llama.wait_ready()
        ready = round(time.perf_counter() - start, 1)
        bench.log(f"llama-server ready in {ready:.1f} s on {llama.url}")
        watch = RssWatch(llama.proc.pid)
        client = Client(llama.url)
        try:
            levels = measure(bench, client, body(SMOL_NAME, {"cache_prompt": False}), LLAMA)
        finally:
            client.close()
            rss = watch.stop()
    finally:
        llama.stop()
    result["servers"][LLAMA] = {
        "command": llama.command,
        "version": llama_version(binary),
        "precision": "GGUF as stored (Q4_1 weights)",
        "slots": slots,
        "ctx_per_slot": per_slot,
        "threads": bench.threads,
        "ready_s": ready,
        "levels": levels,
        "rss": rss,
    }

    # saker: the embedded model as it serves it by default, a batch as wide as llama.cpp's slots
    path = smol_path(bench)
    env = bench.server_env()
    extra = {} if "SAKER_MAX_BATCH_ROWS" in env else batch_env(slots)
    if "SAKER_QUANTIZE" not in env:  # the embedded model's default precision: int4 from its GGUF's own codes
        extra["SAKER_QUANTIZE"] = "int4"
    server = bench.start_server(path, f"{SMOL_NAME}-K", extra_env={**extra, "SAKER_SERVED_MODEL_NAME": SMOL_NAME})
    try:
        watch = RssWatch(server.proc.pid)
        client = Client(server.url)
        try:
            card = next((m for m in client.get_json("/v1/models")["data"] if m.get("id") == SMOL_NAME), {})
            levels = measure(bench, client, body(SMOL_NAME, {}), SAKER)
        finally:
            client.close()
            rss = watch.stop()
    finally:
        bench.stop_server(server)
    served_env = {**env, **extra}
    reported = {k: card[k] for k in ("dtype", "precision", "quantization", "quantize") if k in card}
    settings = {"dtype": served_env.get("SAKER_DTYPE", "auto"), "quantize": served_env.get("SAKER_QUANTIZE") or "none"}
    result["servers"][SAKER] = {
        "model_dir": str(path),
        "precision": reported or settings,
        "precision_source": "/v1/models" if reported else "the settings the bench gave it",
        "precision_settings": settings,
        "max_batch_size": int(served_env.get("SAKER_MAX_BATCH_ROWS", slots)),
        "threads": bench.threads,
        "ready_s": bench.server_info.get(f"{SMOL_NAME}-K", {}).get("ready_s"),
        "levels": levels,
        "rss": rss,
    }
    result["comparison"] = compare({side: result["servers"][side]["levels"] for side in SIDES})
    return result


# -- the table --------------------------------------------------------------------------------------------------------
def _fig(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}" if value < 100 else f"{value:.0f}"


def _goal_text(row: dict, measure: str) -> str:
    goal = row.get("goal")
    if not goal or goal["measure"] != f"{measure}_ratio":
        return ""
    return f"{goal['op']} {goal['value']:g}: {met(row.get('met'))}"


def rows(result: dict) -> list[Row]:
    if "skipped" in result:
        return [("K", "saker vs llama.cpp's server", "-", result["skipped"], "")]
    out: list[Row] = []
    for row in result.get("comparison", []):
        clients = row["clients"]
        label = f"{clients} client" + ("s" if clients > 1 else "")
        tps, mspt = row["tokens_per_s"], row["ms_per_token"]
        kind = "decode ms/token" if clients == 1 else "request ms/token"
        out.append(
            (
                "K",
                f"{label}: {kind}, saker / llama.cpp",
                _fig(row["ms_per_token_ratio"]),
                f"saker {_fig(mspt[SAKER])} ms, llama.cpp {_fig(mspt[LLAMA])} ms",
                _goal_text(row, "ms_per_token"),
            )
        )
        out.append(
            (
                "K",
                f"{label}: tokens/s, saker / llama.cpp",
                _fig(row["tokens_per_s_ratio"]),
                f"saker {_fig(tps[SAKER])} tok/s, llama.cpp {_fig(tps[LLAMA])} tok/s",
                _goal_text(row, "tokens_per_s"),
            )
        )
    servers = result.get("servers", {})
    if all(side in servers for side in SIDES):
        rss = {side: servers[side]["rss"] for side in SIDES}
        precision = ", ".join(f"{k} {v}" for k, v in servers[SAKER]["precision"].items())
        out.append(
            (
                "K",
                "peak RSS MiB (process tree), saker / llama.cpp",
                f"{_fig(rss[SAKER]['peak_mib'])} / {_fig(rss[LLAMA]['peak_mib'])}",
                f"idle {_fig(rss[SAKER]['idle_mib'])} / {_fig(rss[LLAMA]['idle_mib'])}; saker {precision}, "
                f"llama.cpp {servers[LLAMA]['precision']}",
                "",
            )
        )
    return out
