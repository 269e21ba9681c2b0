"""``python -m app reliability``: the reliability figures of the hardening issue. A measurement, not a test: it
starts its own gunicorn on 127.0.0.1 (``gunicorn.conf.py``, saker's worker) against ``--model`` (default: the
embedded SmolLM2-135M-Instruct, converted once into ``--cache-dir``), runs the sections below, prints a table and
writes a JSON report (``--out``). ``--quick`` is the bounded form CI runs (tests/test_reliability.py).

Sections (``--only load,bad,slow,memory,close``; all by default):

- load    16, 32 and 64 closed-loop clients (threads, plain ``http.client``) for ``--load-seconds`` each: plain and
          streamed completions and chat completions; one client in four drops every request it sends (a stream is
          closed after its first frames, a plain request's socket right after it is sent). Each request is
          answered (200, whole: a stream ends with ``[DONE]``), busy (a clean 429/503 in the OpenAI error shape
          with ``Retry-After``), dropped (by us), or lost: anything else (a connection error we did not cause, a
          5xx or another status, a truncated stream, an error frame). Goal: lost = 0, and the server's running and
          queued counts back to 0 afterwards (no slot kept by a dropped request).
- bad     a corpus of malformed and hostile requests over raw sockets: bad JSON, wrong types and huge numbers in
          every field, deep nesting, invalid UTF-8, lone surrogates, bad logit_bias keys, bad response_format /
          structured_outputs / tools / messages, malformed chunked bodies, gzip bombs, unknown encodings, protocol
          errors (bad Content-Length, HTTP/0.9, oversized request line and headers, ...). Goal: no answer >= 500,
          every error answer JSON in the OpenAI shape, and a normal request answered 200 afterwards.
- slow    ``--slow-clients`` connections (200) that send their request head one line every 2 s, reconnecting when
          answered 408, for ``--slow-seconds``, while a normal client sends a completion and a /health every 0.5 s.
          Goal: all slow connections held at once and every normal request answered (its latency is reported).
- memory  the gunicorn worker's RSS (VmRSS of the worker and its children, every 50 ms) before, during and after
          the worst legal request (a prompt filling the context minus 92 tokens, n = best_of = 20, logprobs 20,
          echo, max_tokens null: it may be refused 400 because its candidates cannot fit the KV budget, which is a
          correct answer) and a variant that fits (n = best_of = 2, max_tokens 16). Bound: the RSS at ready + the
          KV budget in bytes (``saker_kv_cache_budget_tokens`` x 2 x layers x KV heads x head size x dtype bytes)
          + a transient allowance of two prefill chunks of float32 logits (chunk x vocabulary x 4 bytes x 2).
          Full mode also runs a sequence on a second server with a small budget (``--memory-budget-tokens``, 4096):
          a long prompt (half the budget), then a request of 2 x SAKER_MAX_BATCH_SIZE one-word rows.
- close   how long the server works on after its client leaves: a long stream (max_tokens 4000, ignore_eos) and
          a long plain request (also one with a ``stop`` string), closed by the client after ~1 s of decoding, and
          (full mode) a stream and a plain request closed while a long prompt is still being prefilled. Measured
          from the close to ``saker_requests_running`` back to 0 (/metrics polled every 20 ms) and to the server's
          "ended early" log line, compared with one decode step and one prefill chunk (timed on the same server
          from ``X-Saker-*`` headers). Goal: <= one step (or chunk).

Timing and memory figures are reported, never asserted; the exit status is 1 when a correctness goal is missed
(lost requests, 5xx, non-JSON errors, slow clients starving the server, a slot never released), else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gzip
import http.client
import json
import os
import platform
import random
import re
import select
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.processes import stop_process

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = ROOT / ".cache" / "saker"
DEFAULT_OUT = ROOT / ".cache" / "reliability" / "reliability.json"
SECTIONS = ("load", "bad", "slow", "memory", "close")
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "Write a short poem about the sea.",
    "List three colours:",
    "def add(a, b):",
    "Hello there, how are you today?",
]


@dataclass
class Plan:
    levels: tuple[int, ...] = (16, 32, 64)
    load_seconds: float = 60.0
    drop_every: int = 4  # one client in this many drops its requests
    values: str = "full"  # the wrong-type values tried in every field: full or quick
    slow_clients: int = 200
    slow_seconds: float = 60.0
    slow_interval: float = 2.0
    memory_variants: tuple[str, ...] = ("worst", "fits")
    close_cases: tuple[str, ...] = (
        "stream-decode",
        "plain-decode",
        "plain-stop-decode",
        "stream-prefill",
        "plain-prefill",
    )
    close_after: float = 1.0

    @classmethod
    def quick(cls) -> "Plan":
        return cls(
            levels=(16, 64),
            load_seconds=5.0,
            values="quick",
            slow_clients=50,
            slow_seconds=20.0,
            memory_variants=("fits",),
            close_cases=("stream-decode", "plain-decode"),
        )


# ---------------------------------------------------------------------------------------------------------------
# the server
# ---------------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """gunicorn -c gunicorn.conf.py wsgi:app on 127.0.0.1 in its own process group; its log (and saker's JSON
    access log) in files under ``log_dir``."""

    def __init__(self, model_dir: Path, name: str, env: dict[str, str], log_dir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"gunicorn-{self.port}.log"
        self.access_path = log_dir / f"access-{self.port}.log"
        self.env = {
            "SAKER_MODEL": str(model_dir),
            "SAKER_SERVED_MODEL_NAME": name,
            "SAKER_LOG_LEVEL": "info",
            "SAKER_ACCESS_LOG": str(self.access_path),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **env,
        }
        # our private server on 127.0.0.1 needs no API keys (we would not know them)
        inherited = {k: v for k, v in os.environ.items() if k.upper() not in ("SAKER_API_KEYS", "SAKER_API_KEY_FILE")}
        gunicorn = str(Path(sys.executable).parent / "gunicorn")
        self.log = open(self.log_path, "w+")
        self.proc = subprocess.Popen(
            [gunicorn, "-c", "gunicorn.conf.py", "-b", f"127.0.0.1:{self.port}", "wsgi:app"],
            cwd=ROOT,
            env={**inherited, **self.env},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 600) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited {self.proc.returncode}:\n{self.output()[-3000:]}")
            answer = exchange(self.port, build("GET", "/health"), timeout=5)
            if answer.status == 200:
                return time.monotonic() - start
            time.sleep(0.2)
        raise TimeoutError(f"gunicorn not ready after {timeout:.0f} s:\n{self.output()[-3000:]}")

    def worker_pids(self) -> list[int]:
        """The master's children (the workers) and theirs (an engine process), recursively."""
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            try:
                children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
            except OSError:
                children = []
            out.extend(children)
            todo.extend(children)
        return out

    def rss_bytes(self) -> int:
        total = 0
        for pid in self.worker_pids():
            with contextlib.suppress(OSError, ValueError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        return total

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def access_lines(self) -> list[dict]:
        if not self.access_path.exists():
            return []
        out = []
        for line in self.access_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def stop(self, timeout: float = 60) -> None:
        stop_process(self.proc, signal.SIGTERM, timeout)
        if not self.log.closed:
            self.log.close()


# ---------------------------------------------------------------------------------------------------------------
# raw HTTP
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Answer:
    status: int | None  # None: the connection closed (or failed) without an answer
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    error: str | None = None  # what went wrong on our side of the socket, if anything
    seconds: float = 0.0

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None


def build(
    method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None, version: str = "HTTP/1.1"
) -> bytes:
    """A request's bytes; Host, Connection: close and (with a body, unless given) Content-Length are added."""
    headers = dict(headers or {})
    names = {k.lower() for k in headers}
    lines = [f"{method} {path} {version}"]
    if "host" not in names:
        lines.append("Host: 127.0.0.1")
    if "connection" not in names:
        lines.append("Connection: close")
    if body is not None and "content-length" not in names and "transfer-encoding" not in names:
        lines.append(f"Content-Length: {len(body)}")
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


def exchange(
    port: int, data: bytes | list[bytes], *, shut: bool = False, timeout: float = 60, pause: float = 0.0
) -> Answer:
    """Send ``data`` (parts, ``pause`` seconds apart) on a new connection and read the answer until the server
    closes it (or the first answer is complete)."""
    parts = [data] if isinstance(data, bytes) else list(data)
    started = time.monotonic()
    raw, error = b"", None
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    except OSError as exc:
        return Answer(None, error=f"connect: {exc!r}")
    with sock:
        try:
            for i, part in enumerate(parts):
                if i and pause:
                    time.sleep(pause)
                sock.sendall(part)
            if shut:
                sock.shutdown(socket.SHUT_WR)
        except OSError as exc:  # the server answered (and closed) before taking all of it
            error = f"send: {exc!r}"
        try:
            while not _complete(raw):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                raw += chunk
        except OSError as exc:
            error = f"{error + '; ' if error else ''}recv: {exc!r}"
    answer = parse_answer(raw)
    answer.error = error if answer.status is None else None
    answer.seconds = time.monotonic() - started
    return answer


def _complete(raw: bytes) -> bool:
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return False
    if head.startswith(b"HTTP/1.1 100") or head.startswith(b"HTTP/1.0 100"):
        return _complete(body)
    headers = _headers(head)
    if "content-length" in headers:
        with contextlib.suppress(ValueError):
            return len(body) >= int(headers["content-length"])
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return body.endswith(b"0\r\n\r\n")
    return False


def _headers(head: bytes) -> dict[str, str]:
    out = {}
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            out[name.decode("latin-1").strip().lower()] = value.decode("latin-1").strip()
    return out


def parse_answer(raw: bytes) -> Answer:
    head, sep, body = raw.partition(b"\r\n\r\n")
    while sep and re.match(rb"HTTP/1\.[01] 100 ", head):
        head, sep, body = body.partition(b"\r\n\r\n")
    match = re.match(rb"HTTP/\d(?:\.\d)? (\d{3})", head)
    if not match:
        return Answer(None, body=raw[:500])
    headers = _headers(head)
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = _dechunk(body)
    elif "content-length" in headers:
        with contextlib.suppress(ValueError):
            body = body[: int(headers["content-length"])]
    return Answer(int(match.group(1)), headers, body)


def _dechunk(data: bytes) -> bytes:
    out, rest = b"", data
    while rest:
        size_line, sep, rest = rest.partition(b"\r\n")
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            break
        if size == 0:
            break
        out += rest[:size]
        rest = rest[size + 2 :]
    return out


def is_error_object(body: Any) -> bool:
    return (
        isinstance(body, dict)
        and list(body) == ["error"]
        and isinstance(body["error"], dict)
        and set(body["error"]) == {"message", "type", "param", "code"}
        and isinstance(body["error"]["message"], str)
    )


def metrics(port: int, timeout: float = 30) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    answer = exchange(port, build("GET", "/metrics"), timeout=timeout)
    if answer.status != 200:
        raise RuntimeError(f"/metrics answered {answer.status}: {answer.body[:200]!r} {answer.error or ''}")
    out = {}
    for family in text_string_to_metric_families(answer.body.decode("utf-8", "replace")):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(values: dict, name: str, **labels) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


def statuses(values: dict) -> Counter:
    """saker_requests_total on the two completion routes, by status."""
    out: Counter = Counter()
    for (name, labels), value in values.items():
        d = dict(labels)
        if name == "saker_requests_total" and d.get("route") in ("/v1/completions", "/v1/chat/completions"):
            out[d["status"]] += int(value)
    return out


def post_json(port: int, path: str, body: dict, timeout: float = 600) -> tuple[Answer, dict]:
    """A plain POST with http.client; the answer and its parsed JSON ({} when it is not JSON)."""
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        answer = Answer(
            resp.status, {k.lower(): v for k, v in resp.getheaders()}, data, seconds=time.monotonic() - started
        )
    except (OSError, http.client.HTTPException) as exc:
        return Answer(None, error=repr(exc), seconds=time.monotonic() - started), {}
    finally:
        conn.close()
    parsed = answer.json()
    return answer, parsed if isinstance(parsed, dict) else {}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


# ---------------------------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------------------------
class Run:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.plan = Plan.quick() if args.quick else Plan()
        if args.clients:
            self.plan.levels = tuple(int(x) for x in args.clients.split(",") if x.strip())
        for name in ("load_seconds", "slow_clients", "slow_seconds"):
            if getattr(args, name) is not None:
                setattr(self.plan, name, getattr(args, name))
        if args.close_cases:
            self.plan.close_cases = tuple(x.strip() for x in args.close_cases.split(",") if x.strip())
        self.sections = [s.strip() for s in (args.only or ",".join(SECTIONS)).split(",") if s.strip()]
        unknown = set(self.sections) - set(SECTIONS)
        if unknown:
            raise SystemExit(f"saker reliability: unknown sections {sorted(unknown)}; choose from {SECTIONS}")
        self.server: Server | None = None
        self.model_dir: Path | None = None
        self.config: dict = {}
        self.name = "model"
        self.context = 0
        self.vocab = 0
        self.chat_template_given = False
        self.server_env: dict[str, str] = {}
        self.report: dict[str, Any] = {}
        self.goals: list[dict] = []

    def log(self, message: str) -> None:
        print(f"[reliability {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    def goal(self, section: str, what: str, met: bool | None, figure: str, correctness: bool) -> None:
        """A goal line: ``correctness`` goals decide the exit status; the others (timing, memory) are reported."""
        self.goals.append({"section": section, "goal": what, "met": met, "figure": figure, "correctness": correctness})

    # -- set-up ---------------------------------------------------------------------------------------------
    def model(self) -> Path:
        if self.args.model:
            return Path(self.args.model).expanduser().resolve()
        from app.engine.loader import ensure_default_model
        from app.settings import Settings

        self.log("converting/checking the embedded SmolLM2 (once)")
        return ensure_default_model(Settings(cache_dir=str(Path(self.args.cache_dir).expanduser().resolve())))

    def start(self) -> None:
        self.model_dir = self.model()
        self.config = json.loads((self.model_dir / "config.json").read_text())
        self.name = self.args.served_name or self.model_dir.name
        env = {}
        for item in self.args.server_env or []:
            key, sep, value = item.partition("=")
            if not sep:
                raise SystemExit(f"saker reliability: --server-env {item!r} is not KEY=VALUE")
            env[key] = value
        if not self._has_chat_template() and "SAKER_CHAT_TEMPLATE" not in env:
            env["SAKER_CHAT_TEMPLATE"] = PLAIN_TEMPLATE  # so chat requests can be part of the mix
            self.chat_template_given = True
        self.server_env = env
        log_dir = Path(self.args.out).expanduser().resolve().parent
        self.server = Server(self.model_dir, self.name, env, log_dir)
        self.log(f"starting gunicorn on {self.server.url} with {self.model_dir} (log {self.server.log_path})")
        ready_s = self.server.wait_ready()
        _, info = post_json(self.port, "/tokenize", {"prompt": "hello " * 100})
        _, more = post_json(self.port, "/tokenize", {"prompt": "hello " * 200})
        self.context = int(info.get("max_model_len") or 0)
        per_word = (int(more.get("count") or 200) - int(info.get("count") or 100)) / 100
        self.hello_tokens_per_word = per_word if per_word > 0 else 1.0
        self.hello_tokens_extra = max(0.0, int(info.get("count") or 100) - 100 * self.hello_tokens_per_word)
        self.vocab = int(self.config.get("vocab_size") or 0)
        self.report["server"] = {
            "model": str(self.model_dir),
            "served_name": self.name,
            "context": self.context,
            "ready_s": round(ready_s, 1),
            "workers": self.server.worker_pids(),
            "env": {k: v for k, v in env.items() if k != "SAKER_CHAT_TEMPLATE"},
            "chat_template": "a plain one given by this script" if self.chat_template_given else "the model's own",
            "log": str(self.server.log_path),
        }
        self.rss_at_ready = self.server.rss_bytes()
        self.log(
            f"ready in {ready_s:.1f} s; context {self.context} tokens, worker RSS {self.rss_at_ready / 2**20:.0f} MiB"
        )

    def _has_chat_template(self) -> bool:
        assert self.model_dir is not None
        if (self.model_dir / "chat_template.jinja").exists() or (self.model_dir / "chat_template.json").exists():
            return True
        with contextlib.suppress(OSError, ValueError):
            return bool(json.loads((self.model_dir / "tokenizer_config.json").read_text()).get("chat_template"))
        return False

    def hello_words(self, tokens: int) -> int:
        """How many "hello " make a prompt of about ``tokens`` tokens (8100 -> 8099 on SmolLM2)."""
        return max(1, int((tokens - self.hello_tokens_extra) / self.hello_tokens_per_word))

    def random_ids(self, n: int, rng: random.Random) -> list[int]:
        hi = max(10, min(self.vocab, 30000) - 5)
        return [rng.randrange(5, hi) for _ in range(n)]

    def settle(self, timeout: float = 60.0) -> tuple[bool, float, dict]:
        """Wait until the server works on nothing (running, queued and in-flight besides this scrape all 0)."""
        start = time.monotonic()
        values: dict = {}
        while time.monotonic() - start < timeout:
            with contextlib.suppress(Exception):
                values = metrics(self.port)
                if (
                    sample(values, "saker_requests_running") == 0
                    and sample(values, "saker_queue_depth") == 0
                    and sample(values, "saker_requests_in_flight") <= 1
                ):
                    return True, time.monotonic() - start, values
            time.sleep(0.1)
        return False, time.monotonic() - start, values

    def run(self) -> dict:
        started = time.time()
        self.report["started"] = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
        self.report["machine"] = {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average_at_start": list(os.getloadavg()),
        }
        self.report["plan"] = {**self.plan.__dict__, "quick": bool(self.args.quick), "sections": self.sections}
        try:
            self.start()
            for section in self.sections:
                self.log(f"section {section}")
                t0 = time.monotonic()
                try:
                    result = getattr(self, f"section_{section}")()
                except Exception as exc:
                    import traceback

                    result = {"error": repr(exc), "traceback": traceback.format_exc()}
                    self.goal(section, "the section ran", False, repr(exc)[:200], True)
                result["seconds"] = round(time.monotonic() - t0, 1)
                result["worker_rss_after"] = self.server.rss_bytes() if self.server else None
                self.report[section] = result
            self.report["server"].update(self.server_health())
        finally:
            if self.server is not None:
                self.server.stop()
        self.report["seconds"] = round(time.time() - started, 1)
        self.report["machine"]["load_average_at_end"] = list(os.getloadavg())
        self.report["goals"] = self.goals
        self.report["ok"] = all(g["met"] for g in self.goals if g["correctness"])
        return self.report

    def server_health(self) -> dict:
        out = self.server.output() if self.server else ""
        health = {
            "tracebacks_in_log": out.count("Traceback"),
            "workers_booted": out.count("Booting worker"),
            "worker_exits": len(re.findall(r"Worker \(pid:\d+\) (?:exited|was sent)", out)),
        }
        self.goal(
            "server",
            "no traceback and no worker restart in the server log",
            health["tracebacks_in_log"] == 0 and health["workers_booted"] == 1,
            f"{health['tracebacks_in_log']} tracebacks, {health['workers_booted']} worker boots",
            True,
        )
        return health

    # -- a: load with drops -----------------------------------------------------------------------------------
    def load_body(self, kind: str, rng: random.Random) -> tuple[str, dict]:
        stream = kind.endswith("stream")
        common = {
            "model": self.name,
            "max_tokens": rng.randint(8, 32),
            "temperature": 0.8,
            "seed": rng.randrange(2**31),
            "stream": stream,
        }
        if kind.startswith("chat"):
            return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}
        return "/v1/completions", {**common, "prompt": rng.choice(PROMPTS), "ignore_eos": True}

    def one_load_request(self, kind: str, dropper: bool, rng: random.Random) -> tuple[str, str | None, float]:
        """One request of the load: ("answered" | "busy" | "dropped" | "lost", a note for the lost, Retry-After)."""
        path, body = self.load_body(kind, rng)
        payload = json.dumps(body).encode()
        if dropper and not body["stream"]:
            return _with_retry(self._plain_drop(path, payload, rng))
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        sock = None
        try:
            conn.connect()
            sock = conn.sock
            conn.request("POST", path, body=payload, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                return _with_retry(_busy_or_lost(resp.status, resp.getheader("Retry-After"), resp.read()))
            if not body["stream"]:
                data = resp.read()
                obj = json.loads(data)
                ok = isinstance(obj, dict) and obj.get("choices") and isinstance(obj.get("usage"), dict)
                return ("answered", None, 0) if ok else ("lost", f"200 without choices/usage: {data[:200]!r}", 0)
            frames = 0
            while True:
                line = resp.readline()
                if not line:
                    return "lost", f"{kind}: stream ended without [DONE] after {frames} frames", 0
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return "answered", None, 0
                obj = json.loads(data)
                if "error" in obj:
                    return "lost", f"{kind}: error frame: {obj['error']}", 0
                frames += 1
                if dropper and frames >= 2:
                    _hard_close(sock)
                    return "dropped", None, 0
        except (OSError, http.client.HTTPException, ValueError) as exc:
            return "lost", f"{kind}: {exc!r}", 0
        finally:
            conn.close()

    def _plain_drop(self, path: str, payload: bytes, rng: random.Random) -> tuple[str, str | None]:
        """Send a plain request and close the socket a moment later (unless it was answered by then)."""
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        except OSError as exc:
            return "lost", f"connect: {exc!r}"
        try:
            sock.sendall(build("POST", path, payload, {"Content-Type": "application/json"}))
            sock.settimeout(rng.uniform(0.05, 0.8))
            try:
                first = sock.recv(65536)
            except socket.timeout:
                _hard_close(sock)
                return "dropped", None
            if not first:
                return "lost", "the server closed the connection without an answer"
            sock.settimeout(30)
            raw = first
            while not _complete(raw):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                raw += chunk
            answer = parse_answer(raw)
            if answer.status == 200:
                return "answered", None
            return _busy_or_lost(answer.status, answer.headers.get("retry-after"), answer.body)
        except OSError as exc:
            return "lost", f"plain drop: {exc!r}"
        finally:
            sock.close()

    def load_level(self, clients: int, seconds: float) -> dict:
        counts: Counter = Counter()
        lost: list[str] = []
        latencies: list[float] = []
        lock = threading.Lock()
        kinds = ("completion", "completion-stream", "chat", "chat-stream")
        before = metrics(self.port)
        barrier = threading.Barrier(clients)
        stop_at = [0.0]

        def client(i: int) -> None:
            rng = random.Random(1000 * clients + i)
            dropper = self.plan.drop_every > 0 and i % self.plan.drop_every == self.plan.drop_every - 1
            if barrier.wait(60) == 0:
                stop_at[0] = time.monotonic() + seconds
            while not stop_at[0]:
                time.sleep(0.001)
            j = 0
            while time.monotonic() < stop_at[0]:
                kind = kinds[(i + j) % len(kinds)]
                j += 1
                t0 = time.monotonic()
                outcome, note, retry = self.one_load_request(kind, dropper, rng)
                with lock:
                    counts["sent"] += 1
                    counts[outcome] += 1
                    counts[f"{outcome}:{kind}"] += 1
                    if outcome == "answered":
                        latencies.append(time.monotonic() - t0)
                    if note:
                        lost.append(note)
                if outcome == "busy":  # a well-behaved client waits Retry-After (here at most 2 s)
                    time.sleep(min(retry, 2.0) * rng.uniform(0.5, 1.0))

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(seconds + 900)
        wall = time.monotonic() - t0
        settled, settle_s, after = self.settle()
        seen_before, seen_after = statuses(before), statuses(after)
        server = {
            status: seen_after[status] - seen_before[status]
            for status in seen_after
            if seen_after[status] - seen_before[status]
        }
        result = {
            "clients": clients,
            "droppers": sum(
                1
                for i in range(clients)
                if self.plan.drop_every and i % self.plan.drop_every == self.plan.drop_every - 1
            ),
            "seconds": round(wall, 1),
            "sent": counts["sent"],
            "answered": counts["answered"],
            "busy_429_503": counts["busy"],
            "dropped_by_us": counts["dropped"],
            "lost": counts["lost"],
            "by_kind": {k: v for k, v in sorted(counts.items()) if ":" in k},
            "answered_latency_p50_s": _round(percentile(latencies, 0.5)),
            "answered_latency_max_s": _round(max(latencies) if latencies else None),
            "server_statuses": dict(sorted(server.items())),
            "settled": settled,
            "settle_s": round(settle_s, 2),
            "lost_examples": lost[:10],
        }
        return result

    def section_load(self) -> dict:
        levels = []
        for clients in self.plan.levels:
            self.log(f"load: {clients} clients for {self.plan.load_seconds:g} s")
            level = self.load_level(clients, self.plan.load_seconds)
            self.log(
                f"load: {clients} clients -> sent {level['sent']}, answered {level['answered']}, busy "
                f"{level['busy_429_503']}, dropped {level['dropped_by_us']}, lost {level['lost']}"
            )
            levels.append(level)
        lost = sum(x["lost"] for x in levels)
        self.goal(
            "load",
            "lost = 0 (16-64 clients, 1 in 4 dropping)",
            lost == 0,
            ", ".join(f"{x['clients']}: {x['lost']} of {x['sent']}" for x in levels),
            True,
        )
        self.goal(
            "load",
            "nothing left running or queued after the load",
            all(x["settled"] for x in levels),
            ", ".join(f"{x['clients']}: {'yes' if x['settled'] else 'NO'} ({x['settle_s']} s)" for x in levels),
            True,
        )
        return {"levels": levels}

    # -- b: bad inputs -------------------------------------------------------------------------------------------
    def bad_cases(self) -> list["Case"]:
        return bad_input_corpus(self.name, quick=self.plan.values == "quick", context=self.context)

    def section_bad(self) -> dict:
        cases = self.bad_cases()
        by_status: Counter = Counter()
        by_group: dict[str, Counter] = {}
        failures: list[dict] = []
        unanswered: list[str] = []
        slowest: list[tuple[float, str]] = []
        growth: list[tuple[int, str]] = []
        rss = self.server.rss_bytes() if self.server else 0
        for case in cases:
            answer = exchange(self.port, case.data, shut=case.shut, timeout=case.timeout, pause=case.pause)
            if self.server:
                now = self.server.rss_bytes()
                growth.append((now - rss, case.name))
                rss = now
            status = answer.status
            key = str(status) if status is not None else "no answer"
            by_status[key] += 1
            by_group.setdefault(case.group, Counter())[key] += 1
            slowest.append((answer.seconds, case.name))
            problem = None
            if status is None:
                unanswered.append(case.name)
                if not case.may_close:
                    problem = f"no answer ({answer.error or 'closed'})"
            elif status >= 500 and status not in case.allowed:
                problem = "5xx"
            elif status >= 400:
                if answer.headers.get("content-type", "").split(";")[
                    0
                ].strip() != "application/json" or not is_error_object(answer.json()):
                    problem = "error answer not JSON in the OpenAI shape"
            if problem:
                failures.append(
                    {
                        "case": case.name,
                        "group": case.group,
                        "problem": problem,
                        "status": status,
                        "answer": answer.body[:300].decode("utf-8", "replace"),
                        "request": case.preview(),
                    }
                )
        normal, _ = post_json(self.port, "/v1/completions", {"model": self.name, "prompt": "Hello", "max_tokens": 4})
        health = exchange(self.port, build("GET", "/health"))
        five = sum(1 for f in failures if f["problem"] == "5xx")
        allowed = [c.name for c in cases if c.allowed]
        not_json = sum(1 for f in failures if f["problem"].startswith("error answer"))
        no_answer = sum(1 for f in failures if f["problem"].startswith("no answer"))
        result = {
            "tried": len(cases),
            "by_status": dict(sorted(by_status.items())),
            "by_group": {g: dict(sorted(c.items())) for g, c in by_group.items()},
            "answers_5xx": five,
            "answers_5xx_allowed": allowed,
            "errors_not_json": not_json,
            "unexpected_no_answer": no_answer,
            "closed_without_answer": unanswered,
            "normal_request_after": normal.status,
            "health_after": health.status,
            "slowest": [{"case": n, "seconds": round(s, 2)} for s, n in sorted(slowest, reverse=True)[:5]],
            "rss_growth_largest": [{"case": n, "bytes": b} for b, n in sorted(growth, reverse=True)[:5]],
            "failures": failures[:40],
        }
        self.goal(
            "bad",
            "no answer >= 500 (besides 501 for an unknown transfer coding, RFC 9112 6.1)",
            five == 0,
            f"{five} of {len(cases)}",
            True,
        )
        self.goal(
            "bad",
            "every error answer JSON in the OpenAI shape",
            not_json == 0 and no_answer == 0,
            f"{not_json} not JSON, {no_answer} unanswered",
            True,
        )
        self.goal(
            "bad",
            "a normal request answered 200 afterwards",
            normal.status == 200 and health.status == 200,
            f"completion {normal.status}, /health {health.status}",
            True,
        )
        return result

    # -- c: slow clients -------------------------------------------------------------------------------------
    def section_slow(self) -> dict:
        n, seconds, interval = self.plan.slow_clients, self.plan.slow_seconds, self.plan.slow_interval
        lock = threading.Lock()
        state = Counter()
        answers: Counter = Counter()
        not_json: list[str] = []
        stop_at = time.monotonic() + seconds
        normal_body = {"model": self.name, "prompt": "Hello", "max_tokens": 4}

        def normal_latencies(count: int) -> list[float]:
            out = []
            for _ in range(count):
                answer, _ = post_json(self.port, "/v1/completions", normal_body, timeout=120)
                out.append(answer.seconds if answer.status == 200 else float("inf"))
            return out

        baseline = normal_latencies(3)

        def slow(i: int) -> None:
            while time.monotonic() < stop_at:
                try:
                    sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
                except OSError:
                    with lock:
                        state["connect_errors"] += 1
                    time.sleep(0.5)
                    continue
                with lock:
                    state["opened"] += 1
                    state["open"] += 1
                    state["max_open"] = max(state["max_open"], state["open"])
                try:
                    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                    line = 0
                    while time.monotonic() < stop_at:
                        readable, _, _ = select.select(
                            [sock], [], [], max(0.0, min(interval, stop_at - time.monotonic()))
                        )
                        if readable:
                            raw = b""
                            sock.settimeout(5)
                            with contextlib.suppress(OSError):
                                while not _complete(raw):
                                    chunk = sock.recv(65536)
                                    if not chunk:
                                        break
                                    raw += chunk
                            answer = parse_answer(raw)
                            with lock:
                                answers[str(answer.status)] += 1
                                if answer.status is not None and not is_error_object(answer.json()):
                                    not_json.append(raw[:200].decode("latin-1"))
                            break
                        if time.monotonic() >= stop_at:
                            break
                        line += 1
                        sock.sendall(b"X-Slow-%d: 1\r\n" % line)
                except OSError:
                    with lock:
                        state["resets"] += 1
                finally:
                    sock.close()
                    with lock:
                        state["open"] -= 1

        threads = [threading.Thread(target=slow, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        time.sleep(min(2.0, seconds / 4))
        normal: list[tuple[int | None, float]] = []
        kinds: list[str] = []
        while time.monotonic() < stop_at - 1:
            answer, _ = post_json(self.port, "/v1/completions", normal_body, timeout=60)
            normal.append((answer.status, answer.seconds))
            health = exchange(self.port, build("GET", "/health"), timeout=60)
            normal.append((health.status, health.seconds))
            kinds += ["completion", "health"]
            time.sleep(0.5)
        for t in threads:
            t.join(seconds + 30)
        ok = [s for status, s in normal if status == 200]
        completions = [s for (status, s), kind in zip(normal, kinds) if status == 200 and kind == "completion"]
        healths = [s for (status, s), kind in zip(normal, kinds) if status == 200 and kind == "health"]
        result = {
            "slow_clients": n,
            "seconds": seconds,
            "line_every_s": interval,
            "connections_opened": state["opened"],
            "held_at_once": state["max_open"],
            "connect_errors": state["connect_errors"],
            "resets": state["resets"],
            "answers_to_slow_clients": dict(answers),
            "slow_answers_not_json": len(not_json),
            "normal_sent": len(normal),
            "normal_answered": len(ok),
            "normal_latency_max_s": _round(max(ok) if ok else None),
            "completion_latency_p50_s": _round(percentile(completions, 0.5)),
            "completion_latency_max_s": _round(max(completions) if completions else None),
            "health_latency_max_s": _round(max(healths) if healths else None),
            "completion_latency_alone_p50_s": _round(percentile(baseline, 0.5)),
        }
        self.goal(
            "slow",
            f"{n} slow connections held while normal requests are answered",
            state["max_open"] >= n and len(ok) == len(normal) and len(normal) > 0 and not not_json,
            f"held {state['max_open']}/{n}, answered {len(ok)}/{len(normal)}, max {result['normal_latency_max_s']} s",
            True,
        )
        return result

    # -- d: memory ---------------------------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> tuple[int, int]:
        c = self.config
        layers = c.get("num_hidden_layers") or c.get("n_layer")
        heads = c.get("num_attention_heads") or c.get("n_head")
        kv_heads = c.get("num_key_value_heads") or heads
        head_dim = c.get("head_dim") or (c.get("hidden_size") or c.get("n_embd")) // heads
        dtype = self.server_env.get("SAKER_DTYPE") or os.environ.get("SAKER_DTYPE") or "auto"
        if dtype == "auto":
            dtype = "float32"  # the CPU default (on CUDA auto is the checkpoint's dtype)
            with contextlib.suppress(Exception):
                import torch

                if torch.cuda.is_available():
                    dtype = str(c.get("dtype") or c.get("torch_dtype") or "float32")
        size = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 4)
        return 2 * layers * kv_heads * head_dim * size, size

    def section_memory(self) -> dict:
        assert self.server is not None
        words = self.hello_words(self.context - 92)
        prompt = "hello " * words
        variants = {
            "worst": {"prompt": prompt, "n": 20, "best_of": 20, "logprobs": 20, "echo": True, "max_tokens": None},
            "fits": {"prompt": prompt, "n": 2, "best_of": 2, "logprobs": 20, "echo": True, "max_tokens": 16},
        }
        out = self.memory_on(
            self.server, self.rss_at_ready, [(n, variants[n]) for n in self.plan.memory_variants], f"'hello ' x {words}"
        )
        budget = self.args.memory_budget_tokens
        if self.args.quick or not budget:
            return out
        # The sequence: a long prompt, then a request of many short rows, on a server with a small KV budget (so
        # that a store that outgrows its budget shows in GiB, not tens of GiB, on a shared machine).
        long_words = self.hello_words(min(self.context - 92, budget // 2))
        rows = 2 * int(self.server_env.get("SAKER_MAX_BATCH_SIZE") or os.environ.get("SAKER_MAX_BATCH_SIZE") or 8)
        sequence = [
            ("long", {"prompt": "hello " * long_words, "n": 1, "max_tokens": 16}),
            ("rows-after-long", {"prompt": "hello", "n": rows, "best_of": rows, "max_tokens": 16}),
        ]
        assert self.model_dir is not None
        small = Server(
            self.model_dir,
            self.name,
            {**self.server_env, "SAKER_KV_CACHE_TOKENS": str(budget)},
            self.server.log_path.parent,
        )
        try:
            small.wait_ready()
            out["small_budget"] = self.memory_on(small, small.rss_bytes(), sequence, f"'hello ' x {long_words}")
            out["small_budget"]["server_env"] = {"SAKER_KV_CACHE_TOKENS": budget}
        finally:
            small.stop()
        return out

    def memory_on(self, server: Server, rss_at_ready: int, variants: list[tuple[str, dict]], prompt_label: str) -> dict:
        """Each variant in turn on ``server``: the worker's RSS every 50 ms from 1 s before to 3 s after."""
        assert self.model_dir is not None
        per_token, dtype_bytes = self.kv_bytes_per_token()
        budget_tokens = int(sample(metrics(server.port), "saker_kv_cache_budget_tokens"))
        chunk = int(
            self.server_env.get("SAKER_PREFILL_CHUNK_TOKENS") or os.environ.get("SAKER_PREFILL_CHUNK_TOKENS") or 512
        )
        weights = sum(
            p.stat().st_size for p in self.model_dir.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file()
        )
        transient = 2 * max(1, min(chunk, self.context)) * max(self.vocab, 1) * 4
        budget_bytes = budget_tokens * per_token
        bound = rss_at_ready + budget_bytes + transient
        out = {
            "kv_bytes_per_token": per_token,
            "dtype_bytes": dtype_bytes,
            "kv_budget_tokens": budget_tokens,
            "kv_budget_bytes": budget_bytes,
            "weights_bytes_on_disk": weights,
            "rss_at_ready": rss_at_ready,
            "transient_allowance_bytes": transient,
            "bound_bytes": bound,
            "variants": {},
        }
        label = "" if server is self.server else f" (KV budget {budget_tokens})"
        for name, fields in variants:
            body = {"model": self.name, **fields}
            _, tok = post_json(server.port, "/tokenize", {"prompt": body["prompt"]})
            prompt_tokens = int(tok.get("count") or 0)
            rows = body.get("best_of") or body.get("n") or 1
            reach = prompt_tokens + (
                body["max_tokens"] if body["max_tokens"] is not None else self.context - prompt_tokens
            )
            samples: list[tuple[float, int]] = []
            stop = threading.Event()
            thread = threading.Thread(target=_sample_rss, args=(server, samples, stop), daemon=True)
            thread.start()
            time.sleep(1.0)
            sent = time.monotonic()
            answer, obj = post_json(server.port, "/v1/completions", body, timeout=3600)
            answered = time.monotonic()
            time.sleep(3.0)
            stop.set()
            thread.join()
            before = [r for t, r in samples if t < sent]
            during = [r for t, r in samples if sent <= t <= answered] or [r for t, r in samples if t >= sent][:1]
            after = [r for t, r in samples if t > answered]
            baseline = int(statistics.median(before)) if before else 0
            peak = max(during + after[:5]) if during else 0
            shown = {k: (prompt_label if k == "prompt" and len(v) > 40 else v) for k, v in body.items()}
            variant = {
                "request": shown,
                "status": answer.status,
                "seconds": round(answer.seconds, 2),
                "prompt_tokens": prompt_tokens,
                "rows": rows,
                "reach_tokens": reach,
                "request_kv_bytes": rows * reach * per_token,
                "baseline_rss": baseline,
                "peak_rss": peak,
                "after_rss": after[-1] if after else None,
                "peak_minus_baseline": peak - baseline,
                "after_minus_baseline": (after[-1] - baseline) if after else None,
                "peak_minus_ready": peak - rss_at_ready,
                "within_bound": peak <= bound,
            }
            if answer.status != 200:
                variant["answer"] = (obj.get("error") or {}).get("message") or answer.body[:300].decode(
                    "utf-8", "replace"
                )
            else:
                variant["usage"] = obj.get("usage")
                variant["timing"] = obj.get("timing")
            out["variants"][name] = variant
            self.log(
                f"memory {name}{label}: {answer.status} in {answer.seconds:.1f} s, RSS {baseline / 2**20:.0f} "
                f"-> {peak / 2**20:.0f} MiB peak -> {(after[-1] if after else 0) / 2**20:.0f} MiB after "
                f"(bound {bound / 2**20:.0f} MiB)"
            )
            self.goal(
                "memory",
                f"{name}{label}: a correct answer (200, or 400 when it cannot fit the KV budget)",
                answer.status == 200 or (answer.status == 400 and "KV" in str(variant.get("answer"))),
                f"{answer.status}",
                True,
            )
            self.goal(
                "memory",
                f"{name}{label}: peak RSS <= RSS at ready + KV budget + transient",
                peak <= bound,
                f"{peak / 2**20:.0f} MiB vs {bound / 2**20:.0f} MiB",
                False,
            )
        return out

    # -- e: client close to work stopped ----------------------------------------------------------------------
    def step_times(self) -> dict:
        rng = random.Random(7)
        chunk = int(
            self.server_env.get("SAKER_PREFILL_CHUNK_TOKENS") or os.environ.get("SAKER_PREFILL_CHUNK_TOKENS") or 512
        )
        chunk = max(16, min(chunk, self.context - 8))
        decode, prefill = [], []
        max_tokens = max(8, min(64, self.context - 32))
        for _ in range(3):
            answer, obj = post_json(
                self.port,
                "/v1/completions",
                {
                    "model": self.name,
                    "prompt": self.random_ids(16, rng),
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "temperature": 0,
                },
            )
            tokens = int((obj.get("usage") or {}).get("completion_tokens") or 0)
            if answer.status == 200 and tokens > 1:
                decode.append(float(answer.headers.get("x-saker-decode-ms", 0)) / (tokens - 1))
            answer, obj = post_json(
                self.port,
                "/v1/completions",
                {"model": self.name, "prompt": self.random_ids(chunk, rng), "max_tokens": 1, "temperature": 0},
            )
            if answer.status == 200:
                prefill.append(float(answer.headers.get("x-saker-prefill-ms", 0)))
        return {
            "decode_step_ms": _round(statistics.median(decode) if decode else None, 2),
            "prefill_chunk_tokens": chunk,
            "prefill_chunk_ms": _round(statistics.median(prefill) if prefill else None, 2),
        }

    def section_close(self) -> dict:
        steps = self.step_times()
        self.log(
            f"close: one decode step {steps['decode_step_ms']} ms, one prefill chunk of "
            f"{steps['prefill_chunk_tokens']} tokens {steps['prefill_chunk_ms']} ms"
        )
        cases = {}
        for name in self.plan.close_cases:
            self.settle()
            cases[name] = self.close_case(name, steps)
            c = cases[name]
            self.log(
                f"close {name}: {c.get('phase')} -> running 0 after {c.get('stop_s_metrics')} s, log line after "
                f"{c.get('stop_s_log')} s"
            )
            reference = steps["prefill_chunk_ms"] if c.get("phase") == "prefill" else steps["decode_step_ms"]
            stop_ms = None if c.get("stop_s_metrics") is None else c["stop_s_metrics"] * 1000
            if c.get("finished_before_close"):
                stop_ms = None  # nothing to measure: it ended before the close
            met = None if stop_ms is None or reference is None else stop_ms <= reference
            if c.get("finished_before_noticed"):
                met = False  # closed mid-generation, and run to its end
            unit = "prefill chunk" if c.get("phase") == "prefill" else "decode step"
            self.goal(
                "close",
                f"{name}: work stopped within one {unit}",
                met,
                f"{stop_ms if stop_ms is None else round(stop_ms)} ms vs {reference} ms",
                False,
            )
            self.goal(
                "close",
                f"{name}: the request's slot released after the close",
                c.get("released", False),
                f"running 0 after {c.get('stop_s_metrics')} s",
                True,
            )
        return {**steps, "cases": cases}

    def close_case(self, name: str, steps: dict) -> dict:
        rng = random.Random(sum(name.encode()))
        stream = name.startswith("stream")
        decode_ms = steps["decode_step_ms"] or 10.0
        chunk_ms = steps["prefill_chunk_ms"] or 100.0
        if name.endswith("prefill"):
            prompt_len = max(16, min(self.context - 64, 8 * steps["prefill_chunk_tokens"]))
            max_tokens = 16
            estimated = prompt_len / steps["prefill_chunk_tokens"] * chunk_ms / 1000
        else:
            prompt_len = 16
            max_tokens = max(8, min(4000, self.context - prompt_len - 1))
            if "-stop-" in name:  # it may run to its end unnoticed: keep that to ~30 s
                max_tokens = max(min(64, max_tokens), min(max_tokens, int(30000 / decode_ms)))
            estimated = max_tokens * decode_ms / 1000
        # decode cases: past the prefill and a few steps into decoding (but well before the end)
        wanted = self.plan.close_after + (0 if name.endswith("prefill") else 4 * decode_ms / 1000)
        close_after = min(wanted, 0.5 * estimated)
        body = {
            "model": self.name,
            "prompt": self.random_ids(prompt_len, rng),
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": stream,
        }
        if "-stop-" in name:
            body["stop"] = ["@@@@@@@@"]  # never met; a stop string makes a plain request's events eager
        log_start = len(self.server.output())
        access_start = len(self.server.access_lines())
        result: dict[str, Any] = {
            "prompt_tokens": prompt_len,
            "max_tokens": max_tokens,
            "close_after_s": round(close_after, 3),
        }
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=60)
        sent = time.monotonic()
        sock.sendall(build("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}))
        received = b""
        finished = False
        sock.settimeout(0.02)
        while time.monotonic() - sent < close_after:
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                continue
            if not chunk:
                finished = True
                break
            received += chunk
            if b"data: [DONE]" in received or (not stream and _complete(received)):
                finished = True
                break
        sock.setblocking(False)  # what already arrived counts as received
        with contextlib.suppress(OSError):
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                received += chunk
        frames = received.count(b"data: {")
        result["frames_received"] = frames
        result["phase"] = "decode" if frames else "prefill"  # a plain request's phase: from its token count
        _hard_close(sock)
        closed = time.monotonic()
        if finished:
            result.update(finished_before_close=True, released=True)
            return result
        stop_metrics = stop_log = stop_access = None
        generated = None
        deadline = closed + 120
        grace = None
        while time.monotonic() < deadline and (stop_metrics is None or stop_log is None):
            if stop_metrics is not None and stop_access is not None:  # over: its log line, if any, is written
                grace = grace or time.monotonic() + 0.5
                if time.monotonic() > grace:
                    break
            if stop_metrics is None:
                with contextlib.suppress(Exception):
                    if sample(metrics(self.port, timeout=5), "saker_requests_running") == 0:
                        stop_metrics = time.monotonic() - closed
            if stop_log is None:
                match = re.search(r"ended early after (\d+) generated tokens", self.server.output()[log_start:])
                if match:
                    stop_log = time.monotonic() - closed
                    generated = int(match.group(1))
            if stop_access is None:
                for line in self.server.access_lines()[access_start:]:
                    if line.get("route") == "/v1/completions":
                        stop_access = time.monotonic() - closed
                        result["access_status"] = line.get("status")
                        result["access_completion_tokens"] = line.get("completion_tokens")
            time.sleep(0.02)
        result.update(
            released=stop_metrics is not None,
            stop_s_metrics=_round(stop_metrics, 3),
            stop_s_log=_round(stop_log, 3),
            stop_s_access_log=_round(stop_access, 3),
            generated_tokens_server=generated,
            seconds_open=round(closed - sent, 3),
        )
        if generated is not None and stream:
            result["tokens_after_close"] = max(0, generated - frames)
        if not stream:
            made = generated if generated is not None else result.get("access_completion_tokens")
            result["phase"] = "decode" if made else "prefill"
        if stop_log is None and result.get("access_status") == 200:
            result["finished_before_noticed"] = True  # it ran to its end before the server saw the close
            result["ran_on_after_close_s"] = _round(stop_access, 3)
        return result


@dataclass
class Case:
    name: str
    group: str
    data: bytes | list[bytes]
    shut: bool = False
    may_close: bool = False  # an incomplete request: the server may close without answering
    timeout: float = 120.0
    pause: float = 0.0
    allowed: tuple[int, ...] = ()  # statuses >= 500 that are this case's correct answer (RFC 9112 501)

    def preview(self) -> str:
        raw = self.data if isinstance(self.data, bytes) else b"".join(self.data)
        return raw[:240].decode("latin-1") + (f"... ({len(raw)} bytes)" if len(raw) > 240 else "")


def _sample_rss(server: Server, samples: list[tuple[float, int]], stop: threading.Event) -> None:
    while not stop.is_set():
        samples.append((time.monotonic(), server.rss_bytes()))
        time.sleep(0.05)


def _busy_or_lost(status: int | None, retry_after: str | None, data: bytes) -> tuple[str, str | None]:
    try:
        body = json.loads(data)
    except ValueError:
        body = None
    if (
        status in (429, 503)
        and is_error_object(body)
        and retry_after
        and retry_after.strip().isdigit()
        and int(retry_after) >= 1
    ):
        return "busy", retry_after.strip()
    return "lost", f"HTTP {status} (Retry-After {retry_after}): {data[:200]!r}"


def _with_retry(outcome: tuple[str, str | None]) -> tuple[str, str | None, float]:
    """(outcome, note) -> (outcome, note for the lost, Retry-After seconds for the busy)."""
    kind, note = outcome
    if kind == "busy":
        return kind, None, float(note or 1)
    return kind, note, 0.0


def _hard_close(sock: socket.socket | None) -> None:
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


# ---------------------------------------------------------------------------------------------------------------
# the bad-input corpus
# ---------------------------------------------------------------------------------------------------------------
COMPLETION_FIELDS = [
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "seed",
    "user",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "response_format",
    "structured_outputs",
    "allowed_token_ids",
    "logprobs_mode",
    "engine",
    "suffix",
    "logprobs",
    "echo",
    "best_of",
]
CHAT_FIELDS = [
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "add_generation_prompt",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "temperature",
    "n",
    "stream",
    "stop",
    "logit_bias",
    "response_format",
    "seed",
]
HUGE = 10**30


def wrong_values(quick: bool) -> list[Any]:
    if quick:
        return ["x", 1.5, -1, HUGE, True, {}, [[[[]]]]]
    return [
        "x",
        "",
        "\ud800",
        1.5,
        -1,
        0,
        2**63,
        HUGE,
        -HUGE,
        1e308,
        -1e308,
        True,
        False,
        None,
        [],
        [1],
        ["x"],
        {},
        {"a": 1},
        [[[[]]]],
    ]


def bad_input_corpus(model: str, quick: bool = False, context: int = 2048) -> list[Case]:
    """Malformed and hostile requests (each a Case of raw bytes). A body is sent with Connection: close."""
    cases: list[Case] = []
    good = {"model": model, "prompt": "Hello", "max_tokens": 2}
    chat = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
    ct = {"Content-Type": "application/json"}

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj).encode()  # ensure_ascii: lone surrogates travel as \\ud800 escapes

    def post(
        name: str, group: str, body: bytes, path: str = "/v1/completions", headers: dict | None = None, **kw
    ) -> None:
        cases.append(Case(name, group, build("POST", path, body, {**ct, **(headers or {})}), **kw))

    # -- wrong types and huge numbers in every field ------------------------------------------------------
    for base, fields, path in (
        (good, COMPLETION_FIELDS, "/v1/completions"),
        (chat, CHAT_FIELDS, "/v1/chat/completions"),
    ):
        for name in fields:
            for value in wrong_values(quick):
                if name in ("max_tokens", "max_completion_tokens") and value is None:
                    continue  # legal: runs to the context (long, not hostile)
                body = {**base, name: value}
                post(f"{path.rsplit('/', 1)[1]}.{name}={json.dumps(value)[:20]}", "wrong types", dumps(body), path)

    # -- JSON itself --------------------------------------------------------------------------------------
    raw_bodies = {
        "truncated": b'{"prompt": "hi", ',
        "single-quotes": b"{'prompt': 'hi'}",
        "trailing-comma": b'{"prompt": "hi",}',
        "form": b"prompt=hi",
        "two-objects": b'{"prompt": "hi"} {"prompt": "again"}',
        "bad-utf8": b'\xff\xfe{"prompt": "hi"}',
        "utf8-in-string-invalid": b'{"prompt": "\xff\xfe\xfd"}',
        "overlong-utf8": b'{"prompt": "\xc0\xaf"}',
        "raw-surrogate-bytes": b'{"prompt": "\xed\xa0\x80"}',
        "bom": b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 2}',
        "utf16": '{"prompt": "hi", "max_tokens": 2}'.encode("utf-16"),
        "empty": b"",
        "spaces": b"   ",
        "null": b"null",
        "list": b"[1, 2]",
        "number": b"5",
        "string": b'"prompt"',
        "true": b"true",
        "NaN": b'{"prompt": "hi", "temperature": NaN}',
        "Infinity": b'{"prompt": "hi", "top_p": Infinity}',
        "-Infinity": b'{"prompt": "hi", "temperature": -Infinity}',
        "1e400": b'{"prompt": "hi", "temperature": 1e400}',
        "max_tokens-1e400": b'{"prompt": "hi", "max_tokens": 1e400}',
        "5000-digit-int": b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
        "5000-digit-seed": b'{"prompt": "hi", "max_tokens": 2, "seed": -' + b"9" * 5000 + b"}",
        "deep-list-1000": b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}",
        "deep-list-100000": b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}",
        "deep-object-50000": b'{"prompt": "hi", "user": ' + b'{"a":' * 50000 + b"1" + b"}" * 50000 + b"}",
        "unclosed-deep": b'{"prompt": ' + b"[" * 100000,
        "schema-2000-deep": b'{"prompt": "hi", "max_tokens": 2, "response_format": {"type": "json_schema", '
        b'"json_schema": {"name": "x", "schema": '
        + b'{"type": "object", "properties": {"a": ' * 2000
        + b'{"type": "string"}'
        + b'}, "required": ["a"]}' * 2000
        + b"}}}",
        "structured-2000-deep": b'{"prompt": "hi", "max_tokens": 2, "structured_outputs": {"json": '
        + b'{"type": "array", "items": ' * 2000
        + b'{"type": "string"}'
        + b"}" * 2000
        + b"}}",
        "nul-in-json": b'{"prompt": "hi\x00"}',
        "control-chars": b'{"prompt": "a\x01\x02\x1f"}',
        "duplicate-keys": b"{" + b'"prompt": "a", ' * 20000 + b'"max_tokens": 2}',
        "many-unknown-keys": dumps({**good, **{f"k{i}": i for i in range(20000)}}),
        "escaped-nul": dumps({**good, "prompt": "a\u0000b"}),
    }
    if quick:
        for name in ("deep-object-50000", "duplicate-keys", "many-unknown-keys", "5000-digit-seed"):
            raw_bodies.pop(name)
    for name, body in raw_bodies.items():
        post(f"json.{name}", "JSON", body)

    # -- strings: surrogates, odd Unicode ------------------------------------------------------------------
    texts = {
        "lone-high-surrogate": "a\ud800b",
        "lone-low-surrogate": "\udfff",
        "surrogate-pair-escaped": "\ud83d\ude00",
        "reversed-pair": "\ude00\ud83d",
        "nul": "\u0000",
        "bidi": "\u202e\u2066abc",
        "noncharacter": "\uffff\ufdd0",
        "emoji-zwj": "👩‍👩‍👧‍👦" * 50,
        "combining": "a" + "\u0301" * 2000,
    }
    for name, text in texts.items():
        post(f"text.prompt.{name}", "strings", dumps({**good, "prompt": text}))
        post(
            f"text.chat.{name}",
            "strings",
            dumps({**chat, "messages": [{"role": "user", "content": text}]}),
            "/v1/chat/completions",
        )
        if not quick:
            post(f"text.stop.{name}", "strings", dumps({**good, "stop": [text]}))
            post(f"text.model.{name}", "strings", dumps({**good, "model": text}))
            post(f"text.logit_bias-key.{name}", "strings", dumps({**good, "logit_bias": {text: 1}}))
            post(f"text.user.{name}", "strings", dumps({**good, "user": text}))
    post("text.tokenize.lone-surrogate", "strings", dumps({"prompt": "\ud800"}), "/tokenize")
    post(
        "text.tokenize.messages-surrogate",
        "strings",
        dumps({"messages": [{"role": "user", "content": "\udc00"}]}),
        "/tokenize",
    )

    # -- huge numbers and sizes ----------------------------------------------------------------------------
    sizes = {
        "max_tokens-2**63": {**good, "max_tokens": 2**63},
        "n-huge": {**good, "n": HUGE},
        "best_of-huge": {**good, "best_of": HUGE, "n": 1},
        "top_k-huge": {**good, "top_k": HUGE},
        "top_k-2**31": {**good, "top_k": 2**31},
        "top_k-2**63": {**good, "top_k": 2**63},
        "seed-2**64": {**good, "seed": 2**64},
        "logprobs-huge": {**good, "logprobs": HUGE},
        "min_tokens-huge": {**good, "min_tokens": HUGE},
        "repetition_penalty-1e308": {**good, "repetition_penalty": 1e308},
        "temperature-5e-324": {**good, "temperature": 5e-324},
        "top_p-5e-324": {**good, "top_p": 5e-324},
        "min_p-1": {**good, "min_p": 1},
        "prompt-ids-huge": {**good, "prompt": [HUGE]},
        "prompt-ids-2**63": {**good, "prompt": [2**63]},
        "stop_token_ids-huge": {**good, "stop_token_ids": [HUGE]},
        "allowed_token_ids-huge": {**good, "allowed_token_ids": [HUGE]},
        "max_tokens-context": {**good, "max_tokens": context},
        "prompt-over-context-ids": {**good, "prompt": [1] * (context + 1)},
        "prompt-3.5MB-text": {**good, "prompt": "hello " * 600_000},
        "prompt-many-short": {**good, "prompt": ["a"] * 64, "max_tokens": 1},
        "stop-100k-chars": {**good, "stop": ["x" * 100_000]},
        "logit_bias-300-keys": {**good, "logit_bias": {str(i): 1 for i in range(1, 300)}},
        "logit_bias-value-1e308": {**good, "logit_bias": {"1": 1e308}},
        "chat-top_logprobs-huge": {**chat, "logprobs": True, "top_logprobs": HUGE},
        "chat-10000-messages": {**chat, "messages": [{"role": "user", "content": "a"}] * 10000},
        "chat-5000-parts": {**chat, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 5000}]},
    }
    if quick:
        sizes.pop("prompt-3.5MB-text")
    for name, body in sizes.items():
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        post(f"size.{name}", "huge numbers and sizes", dumps(body), path, timeout=600)
    post("size.over-body-limit", "huge numbers and sizes", dumps({**good, "prompt": "x" * (5 * 2**20)}))

    # -- logit_bias keys -----------------------------------------------------------------------------------
    for key in [
        "abc",
        "1.5",
        " 1",
        "1 ",
        "\u00b2",
        "\u0661",
        "1_0",
        "0x10",
        "+1",
        "-1",
        "",
        "7" * 5000,
        "99999999999999999999",
        "1e3",
        "٣",
        "１",
    ]:
        post(f"logit_bias.key={key[:12]!r}", "logit_bias", dumps({**good, "logit_bias": {key: 1}}))
    for value in ["x", None, True, [1], {"a": 1}, 101, -101]:
        post(f"logit_bias.value={json.dumps(value)}", "logit_bias", dumps({**good, "logit_bias": {"1": value}}))

    # -- response_format / structured_outputs ---------------------------------------------------------------
    formats = [
        {"type": "sound"},
        "json",
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": "x"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
        {"type": "json_schema", "json_schema": {"name": "a b", "schema": {"type": "object"}}},
        {"type": "json_schema", "json_schema": {"name": "x" * 1000, "schema": {"type": "object"}}},
        {"type": "json_object", "schema": 123},
        {"type": "json_object", "schema": {"type": "hiccup"}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/nope"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}},
        {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
        },
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(a+)+$"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(" * 5000}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "minItems": 10**9}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "minLength": HUGE}}},
        {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}},
        },
        {"type": "json_schema", "json_schema": {"name": "x", "schema": _deep_schema(150)}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": []}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": False}},
    ]
    for i, fmt in enumerate(formats):
        post(f"response_format.{i}:{json.dumps(fmt)[:40]}", "response_format", dumps({**good, "response_format": fmt}))
        if not quick:
            post(
                f"response_format.chat.{i}",
                "response_format",
                dumps({**chat, "response_format": fmt}),
                "/v1/chat/completions",
            )
    structured = [
        {"regex": "a", "choice": ["a"]},
        {},
        {"regex": "a(b"},
        {"choice": []},
        {"choice": ["a", ""]},
        {"json": "{oops"},
        {"grammar": "start: undefined_rule"},
        {"structural_tag": "{}"},
        {"regex": "(" * 10000},
        {"regex": "(a|aa)*" * 200},
        {"regex": "a{1000000000}"},
        {"grammar": "start: " + " ".join(f"r{i}" for i in range(2000))},
        {"json": _deep_schema(150)},
        {"choice": ["x" * 100] * 5000},
        {"regex": 5},
        {"json": 5},
        {"json_object": "yes"},
        {"unknown": 1},
    ]
    for i, so in enumerate(structured):
        post(
            f"structured_outputs.{i}:{json.dumps(so)[:40]}",
            "structured_outputs",
            dumps({**good, "structured_outputs": so}),
            timeout=300,
        )
    post(
        "structured_outputs.stream",
        "structured_outputs",
        dumps({**good, "stream": True, "structured_outputs": {"regex": "a(b"}}),
    )

    # -- chat: messages and tools -------------------------------------------------------------------------
    fn = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    chats = {
        "messages-empty": {"messages": []},
        "messages-string": {"messages": "hi"},
        "role-unknown": {"messages": [{"role": "robot", "content": "x"}]},
        "role-missing": {"messages": [{"content": "x"}]},
        "content-missing": {"messages": [{"role": "user"}]},
        "content-number": {"messages": [{"role": "user", "content": 5}]},
        "content-image": {
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
        },
        "content-part-no-text": {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "content-part-unknown": {"messages": [{"role": "user", "content": [{"type": "sound", "data": "x"}]}]},
        "tool-message-no-id": {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]},
        "assistant-bad-tool_calls": {
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "tool_calls": [{"id": 1, "function": 5}]},
            ]
        },
        "assistant-args-not-json": {
            "messages": [
                {"role": "user", "content": "x"},
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}],
                },
            ]
        },
        "tools-string": {"tools": "f"},
        "tools-list-of-numbers": {"tools": [1]},
        "tools-no-function": {"tools": [{"type": "function"}]},
        "tools-empty-function": {"tools": [{"type": "function", "function": {}}]},
        "tools-type-unknown": {"tools": [{"type": "retrieval", "function": {"name": "f"}}]},
        "tools-duplicate": {"tools": [fn, fn]},
        "tools-parameters-array": {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]
        },
        "tools-parameters-bad-schema": {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "hiccup"}}},
                    },
                }
            ],
            "tool_choice": "required",
        },
        "tool_choice-unknown-name": {"tools": [fn], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        "tool_choice-string": {"tools": [fn], "tool_choice": "sometimes"},
        "tool_choice-required-no-tools": {"tool_choice": "required"},
        "tool_choice-and-response_format": {
            "tools": [fn],
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        "tools-1000": {
            "tools": [
                {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
                for i in range(1000)
            ]
        },
        "top_logprobs-without-logprobs": {"top_logprobs": 3},
    }
    for name, change in chats.items():
        post(f"chat.{name}", "chat", dumps({**chat, **change}), "/v1/chat/completions", timeout=300)

    # -- tokenizer routes ----------------------------------------------------------------------------------
    for name, path, body in [
        ("tokenize-number", "/tokenize", {"prompt": 5}),
        ("tokenize-messages-string", "/tokenize", {"messages": "x"}),
        ("tokenize-both", "/tokenize", {"prompt": "a", "messages": []}),
        ("detokenize-negative", "/detokenize", {"tokens": [-1]}),
        ("detokenize-huge", "/detokenize", {"tokens": [HUGE]}),
        ("detokenize-string", "/detokenize", {"tokens": "x"}),
        ("detokenize-nested", "/detokenize", {"tokens": [[1]]}),
    ]:
        post(f"tokenizer.{name}", "tokenizer routes", dumps(body), path)

    # -- HTTP: content types and encodings ------------------------------------------------------------------
    payload = dumps(good)
    for name, ctype in [
        ("text-plain", "text/plain"),
        ("form", "application/x-www-form-urlencoded"),
        ("multipart", "multipart/form-data; boundary=x"),
        ("xml", "application/xml"),
        ("latin1-charset", "application/json; charset=latin-1"),
        ("garbage", "\x7f/\x01"),
    ]:
        cases.append(
            Case(
                f"http.content-type.{name}",
                "HTTP bodies",
                build("POST", "/v1/completions", payload, {"Content-Type": ctype}),
            )
        )
    limit = 4 * 2**20
    bombs = {
        "gzip-bomb-64MiB": ("gzip", gzip.compress(b" " * (64 * 2**20) + payload, 9)),
        "gzip-bomb-just-over": ("gzip", gzip.compress(b" " * (limit + 1) + payload, 9)),
        "deflate-bomb": ("deflate", zlib.compress(b" " * (64 * 2**20) + payload, 9)),
        "gzip-nested": ("gzip", gzip.compress(gzip.compress(b" " * (16 * 2**20) + payload, 9), 9)),
        "gzip-twice-declared": ("gzip, gzip", gzip.compress(gzip.compress(payload))),
        "gzip-invalid": ("gzip", b"\x1f\x8b not gzip at all"),
        "gzip-truncated": ("gzip", gzip.compress(payload)[:-12]),
        "gzip-empty": ("gzip", b""),
        "deflate-raw": ("deflate", zlib.compress(payload)[2:-4]),
        "br": ("br", payload),
        "compress": ("compress", payload),
        "zstd": ("zstd", payload),
        "identity-garbage": ("identity, gzip", payload),
        "encoding-nonascii": ("gzip\xff", payload),
    }
    for name, (encoding, body) in bombs.items():
        cases.append(
            Case(
                f"http.encoding.{name}",
                "HTTP bodies",
                build("POST", "/v1/completions", body, {**ct, "Content-Encoding": encoding}),
            )
        )
    head_chunked = build("POST", "/v1/completions", None, {**ct, "Transfer-Encoding": "chunked"})
    small = payload
    chunked = {
        "not-hex": [b"ZZ\r\nabc\r\n0\r\n\r\n"],
        "negative": [b"-1\r\nabc\r\n0\r\n\r\n"],
        "short-chunk": [b"10\r\nabc\r\n0\r\n\r\n"],
        "huge-size": [b"ffffffffffffffffffff\r\nabc\r\n0\r\n\r\n"],
        "no-crlf-after-data": [b"%x\r\n%s0\r\n\r\n" % (len(small), small)],
        "extension": [b"%x;name=value\r\n%s\r\n0\r\n\r\n" % (len(small), small)],
        "trailer": [b"%x\r\n%s\r\n0\r\nX-Trailer: 1\r\n\r\n" % (len(small), small)],
        "no-final-chunk": [b"%x\r\n%s\r\n" % (len(small), small)],
        "bare-lf": [b"%x\n%s\n0\n\n" % (len(small), small)],
        "over-limit": [b"%x\r\n%s\r\n" % (65536, b" " * 65536)] * (limit // 65536 + 2),
    }
    for name, parts in chunked.items():
        cases.append(
            Case(
                f"http.chunked.{name}",
                "HTTP bodies",
                [head_chunked, *parts],
                shut=True,
                may_close=name in ("no-final-chunk",),
            )
        )
    cases.append(
        Case(
            "http.gzip-chunked-bomb",
            "HTTP bodies",
            [
                build(
                    "POST", "/v1/completions", None, {**ct, "Transfer-Encoding": "chunked", "Content-Encoding": "gzip"}
                ),
                *(b"%x\r\n%s\r\n" % (len(p), p) for p in [gzip.compress(b" " * (32 * 2**20) + payload, 9)]),
                b"0\r\n\r\n",
            ],
        )
    )
    # body shorter than announced, then the client half-closes: nothing to answer (the client is gone)
    cases.append(
        Case(
            "http.body-shorter-than-length",
            "HTTP bodies",
            build("POST", "/v1/completions", None, {**ct, "Content-Length": "100"}) + b'{"prompt"',
            shut=True,
            may_close=True,
        )
    )
    cases.append(
        Case(
            "http.413-from-content-length",
            "HTTP bodies",
            build("POST", "/v1/completions", None, {**ct, "Content-Length": "100000000"}) + b"{",
        )
    )
    cases.append(
        Case(
            "http.expect-continue-then-silence",
            "HTTP bodies",
            build("POST", "/v1/completions", None, {**ct, "Content-Length": "40", "Expect": "100-continue"}),
            shut=True,
            may_close=True,
        )
    )

    # -- HTTP: protocol errors (gunicorn answers them itself) --------------------------------------------------
    protocol = {
        "http-0.9": b"GET /health\r\n\r\n",
        "http-2.0-version": b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n",
        "http-1.2-version": b"GET /health HTTP/1.2\r\nHost: x\r\n\r\n",
        "version-garbage": b"GET /health HTTP/x.y\r\nHost: x\r\n\r\n",
        "lowercase-method": b"get /health HTTP/1.1\r\nHost: x\r\n\r\n",
        "unknown-method": b"FROB /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "method-with-nonascii": b"G\xc9T /health HTTP/1.1\r\nHost: x\r\n\r\n",
        "garbage-line": b"GARBAGE\r\n\r\n",
        "empty-line-only": b"\r\n\r\n",
        "tls-client-hello": bytes.fromhex("16030100a5010000a10303") + os.urandom(64),
        "binary": bytes(range(256)),
        "bad-content-length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        "negative-content-length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
        "plus-content-length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: +5\r\n\r\n{}   ",
        "huge-content-length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999"
        b"\r\n\r\n{}",
        "two-content-lengths": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3"
        b"\r\n\r\n{}",
        "content-length-list": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2, 2\r\n\r\n{}",
        "cl-and-te": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked"
        b"\r\n\r\n0\r\n\r\n",
        "te-gzip-chunked": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
        b"0\r\n\r\n",
        "te-chunked-gzip": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, gzip\r\n\r\n"
        b"0\r\n\r\n",
        "te-identity": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: identity\r\n\r\n",
        "te-xchunked": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\n",
        "te-twice": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: "
        b"chunked\r\n\r\n0\r\n\r\n",
        "te-in-http-1.0": b"POST /v1/completions HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        "long-request-line": b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        "too-many-headers": b"GET /health HTTP/1.1\r\n" + b"".join(b"X-H%d: 1\r\n" % i for i in range(120)) + b"\r\n",
        "header-too-large": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
        "headers-64KiB": b"GET /health HTTP/1.1\r\n"
        + b"".join(b"X-H%d: %s\r\n" % (i, b"a" * 8000) for i in range(8))
        + b"\r\n",
        "header-no-colon": b"GET /health HTTP/1.1\r\nHost: x\r\nNoColonHere\r\n\r\n",
        "header-name-space": b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header: 1\r\n\r\n",
        "header-obs-fold": b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n",
        "header-nul": b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
        "header-nonascii": b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: \xff\xfe\r\nConnection: close\r\n\r\n",
        "header-bare-lf": b"GET /health HTTP/1.1\nHost: x\n\n",
        "header-bare-cr": b"GET /health HTTP/1.1\rHost: x\r\r\n\r\n",
        "absolute-uri": b"GET http://127.0.0.1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "path-bad-percent": b"GET /health?%zz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "path-nul": b"GET /v1/models/%00 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "path-dotdot": b"GET /v1/../../etc/passwd HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "path-no-slash": b"GET health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "path-star": b"OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "path-nonascii": b"GET /v1/models/\xff\xfe HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "path-long-model-id": b"GET /v1/models/" + b"m" * 4000 + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "no-host-1.1": b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n",
        "expect-unknown": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: teapot\r\nContent-Type: "
        b"application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
        "smuggle-cl-te": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\nTransfer-Encoding: "
        b"chunked\r\n\r\n0\r\n\r\nG",
        "smuggle-te-space": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding : chunked\r\n\r\n0\r\n\r\n",
        "pipelined-bad-then-good": b"GARBAGE\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n",
        "proxy-protocol": b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n",
        "h2-preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    }
    # The client half-closes after each: a head that can never complete (no CRLF CRLF: binary, TLS, bare LFs) is
    # then dropped without an answer (kept open instead, it would be answered 408 after 10 s).
    never_complete = ("empty-line-only", "h2-preface", "tls-client-hello", "binary", "header-bare-lf")
    for name, data in protocol.items():
        cases.append(
            Case(
                f"protocol.{name}",
                "protocol",
                data,
                shut=True,
                timeout=30,
                may_close=name in never_complete,
                allowed=(501,) if name == "te-xchunked" else (),
            )
        )

    # -- routes and methods -----------------------------------------------------------------------------------
    for method, path in [
        ("GET", "/v1/completions"),
        ("PUT", "/v1/completions"),
        ("DELETE", "/v1/completions"),
        ("PATCH", "/v1/chat/completions"),
        ("POST", "/health"),
        ("POST", "/v1/models"),
        ("GET", "/nope"),
        ("GET", "/v1"),
        ("GET", "/v1/models/no-such-model"),
        ("TRACE", "/v1/completions"),
        ("OPTIONS", "/v1/completions"),
        ("CONNECT", "127.0.0.1:80"),
    ]:
        cases.append(Case(f"route.{method} {path}", "routes", build(method, path, None)))
    return cases


def _deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


# ---------------------------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------------------------
def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f} MiB"


def format_table(report: dict) -> str:
    lines = [
        f"saker reliability ({'quick' if report['plan']['quick'] else 'full'}), "
        f"{report['server']['model']}, {report['machine']['cpus']} CPUs, {report['started']}",
        "",
    ]
    load = report.get("load")
    if load and "levels" in load:
        lines.append("load with drops    clients  sent  answered  429/503  dropped  lost  settled  p50 s  max s")
        for x in load["levels"]:
            lines.append(
                f"                   {x['clients']:>7}  {x['sent']:>4}  {x['answered']:>8}  "
                f"{x['busy_429_503']:>7}  {x['dropped_by_us']:>7}  {x['lost']:>4}  "
                f"{'yes' if x['settled'] else 'NO':>7}  {x['answered_latency_p50_s'] or '-':>5}  "
                f"{x['answered_latency_max_s'] or '-':>5}"
            )
        lines.append("")
    bad = report.get("bad")
    if bad and "tried" in bad:
        lines.append(
            f"bad inputs         {bad['tried']} tried; by status {bad['by_status']}; "
            f"5xx {bad['answers_5xx']}; "
            f"errors not JSON {bad['errors_not_json']}; unanswered {bad['unexpected_no_answer']}; "
            f"normal request after: {bad['normal_request_after']}"
        )
        lines.append("")
    slow = report.get("slow")
    if slow and "slow_clients" in slow:
        lines.append(
            f"slow clients       {slow['slow_clients']} connections, one header line every "
            f"{slow['line_every_s']:g} s for {slow['seconds']:g} s: held {slow['held_at_once']} at once "
            f"({slow['connections_opened']} opened, answers {slow['answers_to_slow_clients']}); normal "
            f"requests {slow['normal_answered']}/{slow['normal_sent']} answered; completion p50 "
            f"{slow['completion_latency_p50_s']} s, max {slow['completion_latency_max_s']} s (alone "
            f"{slow['completion_latency_alone_p50_s']} s); /health max {slow['health_latency_max_s']} s"
        )
        lines.append("")
    memory = report.get("memory")
    for part in [memory, memory.get("small_budget")] if memory and "variants" in memory else []:
        if not part:
            continue
        lines.append(
            f"memory             KV budget {part['kv_budget_tokens']} tokens x "
            f"{part['kv_bytes_per_token']} B = "
            f"{_mib(part['kv_budget_bytes'])}; weights {_mib(part['weights_bytes_on_disk'])}; RSS at ready "
            f"{_mib(part['rss_at_ready'])}; bound {_mib(part['bound_bytes'])}"
        )
        for name, v in part["variants"].items():
            lines.append(
                f"  {name:<16} {v['status']} in {v['seconds']} s; RSS {_mib(v['baseline_rss'])} -> peak "
                f"{_mib(v['peak_rss'])} (+{_mib(v['peak_minus_baseline'])}; its KV "
                f"{_mib(v['request_kv_bytes'])}) -> after {_mib(v['after_rss'])}"
            )
        lines.append("")
    close = report.get("close")
    if close and "cases" in close:
        lines.append(
            f"client close       one decode step {close['decode_step_ms']} ms, one prefill chunk "
            f"({close['prefill_chunk_tokens']} tokens) {close['prefill_chunk_ms']} ms"
        )
        for name, c in close["cases"].items():
            if c.get("finished_before_close"):
                lines.append(f"  {name:<17} finished before the close (not measured)")
                continue
            if c.get("finished_before_noticed"):
                lines.append(
                    f"  {name:<17} closed after {c['seconds_open']} s, not noticed: ran to its end "
                    f"({c['access_completion_tokens']} tokens), {c['ran_on_after_close_s']} s after the close"
                )
                continue
            lines.append(
                f"  {name:<17} closed in {c['phase']} after {c['seconds_open']} s: running 0 after "
                f"{c['stop_s_metrics']} s, log line after {c['stop_s_log']} s"
                + (f", {c['tokens_after_close']} tokens after the close" if "tokens_after_close" in c else "")
            )
        lines.append("")
    lines.append("goals")
    for g in report.get("goals", []):
        mark = "ok " if g["met"] else ("n/a" if g["met"] is None else "NOT")
        lines.append(
            f"  [{mark}] {g['section']:<7} {g['goal']}: {g['figure']}" + ("" if g["correctness"] else "  (reported)")
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        help="model directory to serve (default: the embedded SmolLM2-135M-Instruct, converted once into --cache-dir)",
    )
    parser.add_argument("--served-name", help="the model's name in requests (default: the folder's name)")
    parser.add_argument(
        "--cache-dir", default=str(DEFAULT_CACHE), help="where the embedded model is converted (default .cache/saker)"
    )
    parser.add_argument(
        "--out",
        default=str(DEFAULT_OUT),
        help="the JSON report (default .cache/reliability/reliability.json; the server's logs go next to it)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the bounded form for CI: 16 and 64 clients for 5 s, "
        "fewer wrong values, 50 slow clients for 20 s, only the memory variant that fits, no "
        "close-during-prefill cases",
    )
    parser.add_argument("--only", metavar="SECTIONS", help=f"comma-separated sections: {','.join(SECTIONS)}")
    parser.add_argument("--clients", metavar="N,N,...", help="load levels (default 16,32,64; quick 16,64)")
    parser.add_argument("--load-seconds", type=float, default=None, help="seconds per load level (60; quick 5)")
    parser.add_argument("--slow-clients", type=int, default=None, help="slow connections (200; quick 50)")
    parser.add_argument("--slow-seconds", type=float, default=None, help="seconds of slow clients (60; quick 20)")
    parser.add_argument(
        "--close-cases",
        metavar="A,B",
        help="client-close cases to run (default stream-decode,"
        "plain-decode,plain-stop-decode,stream-prefill,plain-prefill; quick: the first two)",
    )
    parser.add_argument(
        "--memory-budget-tokens",
        type=int,
        default=4096,
        metavar="N",
        help="full mode: also run "
        "a long prompt, then a request of 2 x SAKER_MAX_BATCH_SIZE short rows, on a second server "
        "with SAKER_KV_CACHE_TOKENS=N (default 4096; 0: skip)",
    )
    parser.add_argument(
        "--server-env",
        action="append",
        metavar="KEY=VALUE",
        help="extra environment for the server, e.g. SAKER_MAX_QUEUE=4 (repeatable)",
    )


def main(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run = Run(args)
    try:
        report = run.run()
    except KeyboardInterrupt:
        print("saker reliability: interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"saker reliability: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    report["table"] = format_table(report)
    out.write_text(json.dumps(report, indent=1, ensure_ascii=False, default=str) + "\n")
    print(report["table"])
    print(f"\nreport: {out}")
    return 0 if report["ok"] else 1
