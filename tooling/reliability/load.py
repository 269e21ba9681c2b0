"""Section load: closed-loop clients (plain and streamed completions and chat completions), one in four
dropping every request it sends; each request answered, busy (a clean 429/503), dropped (by us) or lost."""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
from collections import Counter

from tooling.reliability.base import RunBase, percentile, rounded
from tooling.reliability.plan import PROMPTS
from tooling.reliability.wire import build, hard_close, is_error_object, metrics, parse_answer, receive, statuses
from tooling.sse import iter_events


class LoadSection(RunBase):
    """``section_load``: the load levels in turn, each a closed loop of clients."""

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
            for event in iter_events(resp):  # each event as soon as it is in
                if event.done:
                    return "answered", None, 0
                obj = event.json()
                if "error" in obj:
                    return "lost", f"{kind}: error frame: {obj['error']}", 0
                frames += 1
                if dropper and frames >= 2:
                    hard_close(sock)
                    return "dropped", None, 0
            return "lost", f"{kind}: stream ended without [DONE] after {frames} frames", 0
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
                hard_close(sock)
                return "dropped", None
            if not first:
                return "lost", "the server closed the connection without an answer"
            sock.settimeout(30)
            raw, failed = receive(sock, first)
            if failed is not None:
                return "lost", f"plain drop: {failed!r}"
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
            "answered_latency_p50_s": rounded(percentile(latencies, 0.5)),
            "answered_latency_max_s": rounded(max(latencies) if latencies else None),
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
