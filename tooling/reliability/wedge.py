"""Section wedge: no request can wedge the server (issue 35). On the run's server: the widest requests the server
accepts (``n`` = ``best_of`` = its ``max_n``) with a few ``max_tokens``, through completions and chat, alone and
then beside closed-loop clients; afterwards nothing is held and a greedy request answers as before. On a second
gunicorn (``tooling.reliability.faulty_wsgi:app``) whose engine steps fail at random (tooling/reliability/faults.py):
every request still ends (whole, or a clean error naming its request id), and the server is left serving with
nothing held."""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import os
import random
import re
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tooling.reliability.base import RunBase, percentile, rounded, wait_settled
from tooling.reliability.plan import FAULT_FILE, PROMPTS
from tooling.reliability.server import Server
from tooling.reliability.wire import build, exchange, is_error_object, metrics, sample
from app.settings import Settings
from tooling.sse import iter_events

GREEDY = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
FAULTY_APP = "tooling.reliability.faulty_wsgi:app"


@dataclass
class Outcome:
    """How one request ended: ``answered`` (200, whole), ``failed`` (a clean server error: a JSON 500 in the
    OpenAI shape, or a stream's error frame then ``[DONE]``), ``busy`` (a clean 429/503 with Retry-After),
    ``refused`` (a 400; the caller judges it) or ``lost`` (anything else: no answer, a time-out, a truncated
    stream, another status or shape)."""

    kind: str
    status: int | None = None
    note: str | None = None
    choices: int = 0
    text: str | None = None
    error: dict = field(default_factory=dict)
    names_request_id: bool = False
    seconds: float = 0.0
    retry_after: float = 0.0


def send(port: int, path: str, body: dict, request_id: str, timeout: float) -> Outcome:
    """``body`` to ``path`` with ``X-Request-ID: request_id``, read to its end (a stream event by event)."""
    started = time.monotonic()
    out = _send(port, path, body, request_id, timeout)
    out.seconds = time.monotonic() - started
    return out


def _send(port: int, path: str, body: dict, request_id: str, timeout: float) -> Outcome:
    want = int(body.get("n") or 1)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(
            "POST",
            path,
            body=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "X-Request-ID": request_id},
        )
        resp = conn.getresponse()
        if resp.status != 200 or not body.get("stream"):
            return _plain(resp.status, resp.getheader("Retry-After"), resp.read(), want, request_id)
        errors, choices, done = [], set(), False
        for event in iter_events(resp):
            if event.done:
                done = True
                break
            obj = event.json()
            if "error" in obj:
                errors.append(obj)
                continue
            if errors:
                return Outcome("lost", 200, f"a frame after the error frame: {event.data[:200]}")
            choices.update(c.get("index") for c in obj.get("choices") or [])
        rest = resp.read()
        if not done:
            return Outcome("lost", 200, f"the stream ended without [DONE] ({len(choices)} choices seen)")
        if rest.strip():
            return Outcome("lost", 200, f"bytes after [DONE]: {rest[:200]!r}")
        if errors:
            error = errors[0]
            if len(errors) == 1 and is_error_object(error) and error["error"]["type"] == "server_error":
                named = request_id in error["error"]["message"]
                return Outcome("failed", 200, error=error["error"], names_request_id=named)
            return Outcome("lost", 200, f"error frames not in the OpenAI shape: {json.dumps(errors)[:300]}")
        if choices != set(range(want)):
            return Outcome("lost", 200, f"stream choices {sorted(choices)[:10]}..., wanted {want}")
        return Outcome("answered", 200, choices=len(choices))
    except (OSError, http.client.HTTPException, ValueError) as exc:
        kind = "a time-out (a hang)" if isinstance(exc, (socket.timeout, TimeoutError)) else "no answer"
        return Outcome("lost", None, f"{kind}: {exc!r}")
    finally:
        conn.close()


def _plain(status: int, retry_after: str | None, data: bytes, want: int, request_id: str) -> Outcome:
    try:
        obj = json.loads(data)
    except ValueError:
        return Outcome("lost", status, f"not JSON: {data[:200]!r}")
    if status == 200:
        choices = obj.get("choices") if isinstance(obj, dict) else None
        if not isinstance(choices, list) or not isinstance(obj.get("usage"), dict):
            return Outcome("lost", status, f"200 without choices/usage: {data[:200]!r}")
        if sorted(c.get("index") for c in choices) != list(range(want)):
            return Outcome("lost", status, f"{len(choices)} choices, wanted {want}")
        first = choices[0] if choices else {}
        text = first.get("text") if "text" in first else (first.get("message") or {}).get("content")
        return Outcome("answered", status, choices=len(choices), text=text)
    if not is_error_object(obj):
        return Outcome("lost", status, f"an error not in the OpenAI shape: {data[:200]!r}")
    error = obj["error"]
    if status == 500 and error["type"] == "server_error":
        named = request_id in error["message"]
        if not named:
            return Outcome("lost", status, f"a 500 that does not name request id {request_id}: {error['message']}")
        return Outcome("failed", status, error=error, names_request_id=True)
    if status in (429, 503) and retry_after and retry_after.strip().isdigit() and int(retry_after) >= 1:
        return Outcome("busy", status, error=error, retry_after=float(retry_after))
    if status == 400:
        return Outcome("refused", status, error=error)
    return Outcome("lost", status, f"HTTP {status}: {error['message'][:200]}")


def get_status(port: int, path: str) -> int | None:
    return exchange(port, build("GET", path), timeout=30).status


class Clients:
    """``count`` closed-loop clients sending ``body(rng, i, j) -> (path, body)`` to ``port`` until ``stop()``
    (or ``seconds`` pass): every request's ``Outcome`` counted, the first notes of those lost kept."""

    def __init__(self, port: int, count: int, body, label: str, timeout: float, seconds: float | None = None):
        self.port, self.body, self.label, self.timeout = port, body, label, timeout
        self.counts: Counter = Counter()
        self.lost: list[str] = []
        self.failed: list[str] = []  # a few of the clean failures' messages
        self.latencies: list[float] = []
        self.names: Counter = Counter()  # failed requests whose error names their request id, or not
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._deadline = None if seconds is None else time.monotonic() + seconds
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(count)]
        for t in self.threads:
            t.start()

    def _client(self, i: int) -> None:
        rng = random.Random(f"{self.label}-{i}")
        for j in itertools.count():
            if self._stop.is_set() or (self._deadline is not None and time.monotonic() >= self._deadline):
                return
            path, body = self.body(rng, i, j)
            kind = ("chat" if "chat" in path else "completion") + ("-stream" if body.get("stream") else "")
            if int(body.get("n") or 1) > 1:
                kind += f"-n{body['n']}"
            out = send(self.port, path, body, f"{self.label}-{i}-{j}", self.timeout)
            with self._lock:
                self.counts["sent"] += 1
                self.counts[out.kind] += 1
                self.counts[f"{out.kind}:{kind}"] += 1
                if out.kind == "failed":
                    where = "stream error frame" if out.status == 200 else "500"
                    self.names[f"{where}: {'names' if out.names_request_id else 'does not name'} its request id"] += 1
                    if out.status == 200:
                        self.counts["failed_in_stream"] += 1
                    if len(self.failed) < 4 and not any(e.startswith(where) for e in self.failed[-1:]):
                        self.failed.append(f"{where} ({kind}, request id {self.label}-{i}-{j}): {out.error['message']}")
                if out.kind == "answered":
                    self.latencies.append(out.seconds)
                if out.kind in ("lost", "refused") and len(self.lost) < 10:
                    self.lost.append(f"{kind}: {out.note or out.error}")
            if out.kind == "busy":
                self._stop.wait(min(out.retry_after, 2.0) * rng.uniform(0.5, 1.0))

    def stop(self, join_timeout: float) -> bool:
        """Stop after the requests under way; False when a client is still in a request ``join_timeout`` later."""
        self._stop.set()
        deadline = time.monotonic() + join_timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)

    def join(self, join_timeout: float) -> bool:
        deadline = time.monotonic() + join_timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)

    def summary(self) -> dict:
        c = self.counts
        return {
            "sent": c["sent"],
            "answered": c["answered"],
            "failed_clean": c["failed"],
            "failed_in_stream": c["failed_in_stream"],
            "busy_429_503": c["busy"],
            "refused_400": c["refused"],
            "lost": c["lost"],
            "by_kind": {k: v for k, v in sorted(c.items()) if ":" in k},
            "failed_naming_request_id": dict(self.names),
            "answered_latency_p50_s": rounded(percentile(self.latencies, 0.5)),
            "answered_latency_max_s": rounded(max(self.latencies) if self.latencies else None),
            "lost_examples": self.lost,
            "failed_examples": self.failed,
        }


class WedgeSection(RunBase):
    """``section_wedge``: the wide requests on the run's server, then the injected faults on a second one."""

    def _env(self, name: str, default):
        return self.server_env.get(name) or os.environ.get(name) or default

    def greedy_text(self, port: int) -> str | None:
        out = send(port, "/v1/completions", {"model": self.name, **GREEDY}, "wedge-greedy", 120)
        return out.text if out.kind == "answered" else None

    def section_wedge(self) -> dict:
        assert self.server is not None
        reference = self.greedy_text(self.port)
        result = {"greedy_prompt": GREEDY["prompt"], "greedy_text_before": reference, "faults": {}}
        modes = list(self.plan.fault_modes)
        # the first faulty server loads its model while the wide requests run (only correctness is judged here)
        first = self.faulty_server(modes[0]) if modes else None
        try:
            result["wide"] = self.wide_requests(reference)
        except BaseException:
            if first is not None:
                first[0].stop()
            raise
        for i, mode in enumerate(modes):
            server, rate_file = first if i == 0 and first is not None else self.faulty_server(mode)
            result["faults"][mode] = self.injected_faults(mode, reference, server, rate_file)
        return result

    # -- wide requests on the run's server --------------------------------------------------------------------
    def wide_body(self, route: str, n: int, max_tokens: int) -> dict:
        common = {"model": self.name, "n": n, "max_tokens": max_tokens, "temperature": 1, "seed": 35}
        if route == "chat":
            return {**common, "messages": [{"role": "user", "content": "Hello"}]}
        return {**common, "prompt": "Hello", "best_of": n}

    def wide_cases(self, cases: list[tuple[str, int]], n: int, label: str, timeout: float) -> list[dict]:
        """The cases in turn, until one is not answered (a server that hangs would make every later one wait
        out its time-out)."""
        out = []
        for route, max_tokens in cases:
            out.append(self.wide_case(route, max_tokens, n, f"{label}-{route}-{max_tokens}", timeout))
            if not out[-1]["ok"]:
                break
        return out

    def wide_case(self, route: str, max_tokens: int, n: int, label: str, timeout: float) -> dict:
        """One wide request; a 400 saying that its candidates cannot fit the KV budget (naming ``n``/``best_of``)
        is a correct answer, and the request is sent again with half the ``n`` until it is taken."""
        path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
        refused: list[int] = []
        while True:
            out = send(self.port, path, self.wide_body(route, n, max_tokens), f"wedge-wide-{label}", timeout)
            kv = (
                out.kind == "refused"
                and out.error.get("param") in ("n", "best_of")
                and "KV" in str(out.error.get("message"))
            )
            if kv and n > 1:
                refused.append(n)
                n //= 2
                continue
            break
        ok = out.kind == "answered" and out.choices == n
        case = {
            "route": path,
            "max_tokens": max_tokens,
            "n_asked": refused[0] if refused else n,
            "n_ran": n,
            "refused_kv_at": refused,
            "status": out.status,
            "choices": out.choices,
            "seconds": round(out.seconds, 2),
            "ok": ok,
        }
        if not ok:
            case["note"] = out.note or out.error
        self.log(f"wedge: {label} {path} n={n} max_tokens={max_tokens} -> {out.status} in {out.seconds:.1f} s")
        return case

    def traffic_body(self, rng: random.Random, i: int, j: int) -> tuple[str, dict]:
        stream = (i + j) % 2 == 1
        body = {
            "model": self.name,
            "prompt": rng.choice(PROMPTS),
            "max_tokens": rng.randint(8, 32),
            "temperature": 0.8,
            "seed": rng.randrange(2**31),
            "ignore_eos": True,
            "stream": stream,
        }
        return "/v1/completions", body

    def wide_requests(self, reference: str | None) -> dict:
        n = int(self._env("SAKER_MAX_N", Settings.model_fields["max_n"].default))
        n = min(n, int(self._env("SAKER_MAX_BEST_OF", Settings.model_fields["max_best_of"].default)))
        cases = [(route, m) for route in ("completions", "chat") for m in self.plan.wedge_max_tokens]
        beside_cases = [(route, m) for route in ("completions", "chat") for m in self.plan.wedge_beside_max_tokens]
        timeout = self.plan.wedge_request_timeout
        alone = self.wide_cases(cases, n, "alone", timeout)
        clients = Clients(self.port, self.plan.wedge_clients, self.traffic_body, "wedge-traffic", timeout)
        beside = self.wide_cases(beside_cases, n, "beside", timeout) if all(c["ok"] for c in alone) else []
        stopped = clients.stop(timeout)
        traffic = clients.summary()
        settled, settle_s, values = self.settle()
        after = self.greedy_text(self.port)
        values = metrics(self.port)
        repairs = sample(values, "saker_engine_repairs_total")
        out = {
            "n": n,
            "alone": alone,
            "beside_traffic": beside,
            "traffic": {**traffic, "clients": self.plan.wedge_clients, "clients_stopped": stopped},
            "settled": settled,
            "settle_s": round(settle_s, 2),
            "kv_cache_usage_after": sample(values, "saker_kv_cache_usage"),
            "greedy_text_after": after,
            "greedy_same": reference is not None and after == reference,
            "repairs_total": repairs,
            "step_failures_total": sample(values, "saker_engine_step_failures_total"),
        }
        wide = alone + beside
        planned = len(cases) + len(beside_cases)
        self.goal(
            "wedge",
            f"every wide request (n = best_of = {n}; completions and chat; max_tokens "
            f"{','.join(map(str, self.plan.wedge_max_tokens))} alone, "
            f"{','.join(map(str, self.plan.wedge_beside_max_tokens))} beside traffic) answered 200 with its n choices",
            len(wide) == planned and all(c["ok"] for c in wide),
            f"{sum(c['ok'] for c in wide)} of {planned}"
            + (f"; ran with n {sorted({c['n_ran'] for c in wide})}" if any(c["refused_kv_at"] for c in wide) else ""),
            True,
        )
        self.goal(
            "wedge",
            "every request beside the wide ones answered (200 whole, or a clean 429/503)",
            traffic["lost"] == 0 and traffic["failed_clean"] == 0 and traffic["refused_400"] == 0 and stopped,
            f"{traffic['answered']} answered, {traffic['busy_429_503']} busy, "
            f"{traffic['lost'] + traffic['failed_clean'] + traffic['refused_400']} not, of {traffic['sent']}",
            True,
        )
        self.goal(
            "wedge",
            "after the wide requests: nothing running or queued, a greedy request answers the same text as before, "
            "no repair (saker_engine_repairs_total 0)",
            settled and out["greedy_same"] and repairs == 0,
            f"settled {'yes' if settled else 'NO'}, greedy {'same' if out['greedy_same'] else 'DIFFERENT'}, "
            f"repairs {repairs:g}",
            True,
        )
        return out

    # -- injected faults on a second server --------------------------------------------------------------------
    def fault_body(self, rng: random.Random, i: int, j: int) -> tuple[str, dict]:
        kinds = ("completion", "completion-stream", "completion-n", "chat", "chat-stream", "completion-n-stream")
        kind = kinds[(i + j) % len(kinds)]
        body = {
            "model": self.name,
            "max_tokens": rng.randint(8, 32),
            "temperature": 0.8,
            "seed": rng.randrange(2**31),
            "stream": kind.endswith("-stream"),
        }
        if kind.startswith("completion-n"):
            body["n"] = body["best_of"] = rng.choice((2, 4, 8))
        if kind.startswith("chat"):
            return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}
        return "/v1/completions", {**body, "prompt": rng.choice(PROMPTS), "ignore_eos": True}

    def faulty_server(self, mode: str) -> tuple[Server, Path]:
        """A second gunicorn (started, not yet ready) whose steps fail at the rate in its fault file (0 for now);
        ``engine-process``: with SAKER_ENGINE_PROCESS=1."""
        assert self.server is not None and self.model_dir is not None
        log_dir = self.server.log_path.parent
        rate_file = log_dir / f"fault-rate-{mode}"
        rate_file.write_text("0")
        env = {**self.server_env, FAULT_FILE: str(rate_file)}
        if mode == "engine-process":
            env["SAKER_ENGINE_PROCESS"] = "1"
        return Server(self.model_dir, self.name, env, log_dir, app=FAULTY_APP), rate_file

    def faults_fired(self, port: int, before: dict, least: int, clients: Clients) -> float:
        """Wait ``fault_seconds``, and on (up to 6 x as long) until ``least`` steps have failed (so that a quiet
        machine's few steps still meet faults); the steps that failed meanwhile."""
        base = sample(before, "saker_engine_step_failures_total")
        tick = threading.Event()
        start = time.monotonic()
        failed = 0.0
        while True:
            elapsed = time.monotonic() - start
            with contextlib.suppress(Exception):
                failed = sample(metrics(port), "saker_engine_step_failures_total") - base
            if elapsed >= 6 * self.plan.fault_seconds or (elapsed >= self.plan.fault_seconds and failed >= least):
                return failed
            if not any(t.is_alive() for t in clients.threads):
                return failed
            tick.wait(0.25)

    def injected_faults(self, mode: str, reference: str | None, server: Server, rate_file: Path) -> dict:
        label = f"wedge faults ({mode})"
        try:
            server.wait_ready()
            workers = sorted(server.worker_pids())
            before = metrics(server.port)
            rate, least = self.plan.fault_rate, self.plan.fault_least
            self.log(
                f"{label}: {self.plan.fault_clients} clients for {self.plan.fault_seconds:g} s and until {least} "
                f"steps failed, p = {rate:g} (log {server.log_path})"
            )
            rate_file.write_text(str(rate))
            timeout = self.plan.fault_request_timeout
            started = time.monotonic()
            clients = Clients(server.port, self.plan.fault_clients, self.fault_body, f"wedge-{mode}", timeout)
            fired = self.faults_fired(server.port, before, least, clients)
            rate_file.write_text("0")
            seconds = time.monotonic() - started
            ended = clients.stop(timeout + 30)
            traffic = clients.summary()
            settled, settle_s, values = wait_settled(server.port)
            failures = sample(values, "saker_engine_step_failures_total") - sample(
                before, "saker_engine_step_failures_total"
            )
            out = {
                "mode": mode,
                "fault_rate": rate,
                "seconds": round(seconds, 1),
                "failed_steps_while_sending": fired,
                "clients": self.plan.fault_clients,
                **traffic,
                "every_client_ended": ended,
                "step_failures": failures,
                "repairs_total": sample(values, "saker_engine_repairs_total"),
                "settled": settled,
                "settle_s": round(settle_s, 2),
                "kv_cache_usage_after": sample(values, "saker_kv_cache_usage"),
                "livez": get_status(server.port, "/livez"),
                "health": get_status(server.port, "/health"),
            }
            out["greedy_text_after"] = self.greedy_text(server.port)
            out["greedy_same"] = reference is not None and out["greedy_text_after"] == reference
            log = server.output()
            out["workers_booted"] = log.count("Booting worker")
            out["worker_exits"] = len(re.findall(r"Worker \(pid:\d+\) (?:exited|was sent)", log))
            out["same_workers"] = sorted(server.worker_pids()) == workers
            out["log"] = str(server.log_path)
        finally:
            server.stop()
            with contextlib.suppress(OSError):
                rate_file.unlink()
        self.log(
            f"{label}: sent {out['sent']}, answered {out['answered']}, failed clean {out['failed_clean']} "
            f"({out['failed_in_stream']} in a stream), busy {out['busy_429_503']}, lost {out['lost']}; "
            f"{failures:g} failed steps"
        )
        self.goal(
            "wedge",
            f"{mode}, steps failing at p = {rate:g}: every request ended (200 whole, a JSON 500 server_error naming "
            "its request id, or a stream's error frame then [DONE]); no connection error, no time-out",
            out["lost"] == 0 and out["refused_400"] == 0 and ended and out["sent"] > 0,
            f"{out['answered']} whole, {out['failed_clean']} failed clean ({out['failed_in_stream']} in a stream), "
            f"{out['busy_429_503']} busy, {out['lost'] + out['refused_400']} not, of {out['sent']}",
            True,
        )
        self.goal(
            "wedge",
            f"{mode}: the faults fired (saker_engine_step_failures_total > 0)",
            failures > 0,
            f"{failures:g} failed steps",
            True,
        )
        named = out["failed_naming_request_id"]
        frames = {k: v for k, v in named.items() if k.startswith("stream")}
        self.goal(
            "wedge",
            f"{mode}: a stream's error frame names its request id, as a failed plain request's 500 does",
            not any("does not name" in k for k in frames) if frames else None,
            ", ".join(f"{k}: {v}" for k, v in sorted(frames.items())) or "no stream failed",
            True,
        )
        held = out["kv_cache_usage_after"]
        self.goal(
            "wedge",
            f"{mode}, afterwards: nothing running or queued, no KV block held (saker_kv_cache_usage 0), no repair",
            settled and held == 0 and out["repairs_total"] == 0,
            f"settled {'yes' if settled else 'NO'}, KV usage {held:g}, repairs {out['repairs_total']:g}",
            True,
        )
        self.goal(
            "wedge",
            f"{mode}, afterwards: /livez and /health 200, the greedy request answers the main server's text, the "
            "same worker (no restart)",
            out["livez"] == 200
            and out["health"] == 200
            and out["greedy_same"]
            and out["same_workers"]
            and out["workers_booted"] == 1
            and out["worker_exits"] == 0,
            f"/livez {out['livez']}, /health {out['health']}, greedy "
            f"{'same' if out['greedy_same'] else 'DIFFERENT'}, {out['workers_booted']} worker boots, "
            f"{out['worker_exits']} exits",
            True,
        )
        return out
