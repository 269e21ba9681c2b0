"""The bench's HTTP client: ``http.client`` over kept-alive connections, one per thread (no client library inside
the measurement), timed requests (plain and streamed) and closed loops of concurrent clients."""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Callable

from tooling.sse import iter_json


@dataclass
class Reply:
    e2e_s: float
    tokens: int
    text: str
    ttft_s: float | None = None  # streaming: first frame that carries a token
    timing: dict | None = None  # the server's timing (saker: body/usage chunk or X-Saker-* headers)
    prompt_tokens: int | None = None
    start: float = 0.0
    end: float = 0.0
    rejected: int = 0  # 429/503 answers retried before this one (closed_loop)
    finish_reason: str | None = None  # the first choice's (non-streamed answers)
    cached_tokens: int | None = None  # prompt tokens the server says it took from its prefix cache, if it says
    index: tuple[int, int] | None = None  # closed_loop: (client, request of that client)
    frame_times: list[float] | None = None  # streaming: when each frame that carries a token arrived


class HTTPError(RuntimeError):
    def __init__(self, message: str, status: int | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class Client:
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0):
        parts = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
        self.https = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if self.https else 80)
        prefix = parts.path.rstrip("/")
        self.prefix = prefix[:-3] if prefix.endswith("/v1") else prefix
        self.url = f"{parts.scheme}://{parts.netloc}{self.prefix}"
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout
        self._local = threading.local()

    def _connection(self, fresh: bool = False) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            conn = cls(self.host, self.port, timeout=self.timeout)
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._local.conn = conn
        return conn

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def get(self, path: str) -> bytes:
        conn = self._connection()
        try:
            conn.request("GET", self.prefix + path, headers=self.headers)
            resp = conn.getresponse()
        except (http.client.RemoteDisconnected, ConnectionError, BrokenPipeError):
            conn = self._connection(fresh=True)
            conn.request("GET", self.prefix + path, headers=self.headers)
            resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise HTTPError(f"GET {path}: HTTP {resp.status}: {data[:300]!r}", resp.status)
        return data

    def get_json(self, path: str) -> dict:
        return json.loads(self.get(path))

    def _send(self, path: str, payload: bytes) -> tuple[http.client.HTTPResponse, float]:
        """Send on the kept-alive connection; a connection the server closed while idle is reopened once (the
        clock starts again with the attempt that counts)."""
        for attempt in (0, 1):
            conn = self._connection(fresh=attempt == 1)
            start = time.perf_counter()
            try:
                conn.request("POST", self.prefix + path, body=payload, headers=self.headers)
                return conn.getresponse(), start
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                if attempt == 1:
                    raise
        raise AssertionError("unreachable")

    def complete(self, body: dict, path: str = "/v1/completions") -> Reply:
        """One /v1/completions request (or ``path``: /v1/chat/completions); streamed when ``body['stream']``."""
        resp, start = self._send(path, json.dumps(body).encode())
        if resp.status != 200:
            data = resp.read()
            retry = resp.getheader("Retry-After")
            raise HTTPError(
                f"POST {path}: HTTP {resp.status}: {data[:500]!r}",
                resp.status,
                float(retry) if retry and retry.replace(".", "", 1).isdigit() else None,
            )
        if body.get("stream"):
            return self._read_stream(resp, start)
        data = resp.read()
        end = time.perf_counter()
        obj = json.loads(data)
        usage = obj.get("usage") or {}
        choices = obj.get("choices") or []
        text = "".join(c.get("text") or (c.get("message") or {}).get("content") or "" for c in choices)
        timing = obj.get("timing") or _header_timing(resp)
        return Reply(
            end - start,
            int(usage.get("completion_tokens", 0)),
            text,
            timing=timing,
            prompt_tokens=usage.get("prompt_tokens"),
            cached_tokens=cached_tokens(usage, timing),
            start=start,
            end=end,
            finish_reason=choices[0].get("finish_reason") if choices else None,
        )

    @staticmethod
    def _read_stream(resp, start: float) -> Reply:
        """An SSE stream (tooling/sse.py's reader, each event as soon as its blank line arrives) up to ``[DONE]``:
        the first frame that carries a token stops the TTFT clock."""
        ttft = None
        frames = 0
        times: list[float] = []
        text = []
        usage = timing = None
        for obj in iter_json(resp):
            if "error" in obj:
                raise HTTPError(f"stream error frame: {obj['error']}")
            for choice in obj.get("choices") or []:
                lp = choice.get("logprobs") or {}
                if choice.get("text") or choice.get("finish_reason") or lp.get("tokens"):
                    times.append(time.perf_counter())
                    if ttft is None:
                        ttft = times[-1] - start
                    frames += 1
                    text.append(choice.get("text") or "")
            if obj.get("usage"):
                usage = obj["usage"]
            if obj.get("timing"):
                timing = obj["timing"]
        resp.read()  # the chunked terminator, so the connection can be reused
        end = time.perf_counter()
        tokens = int(usage["completion_tokens"]) if usage else frames
        return Reply(
            end - start,
            tokens,
            "".join(text),
            ttft_s=ttft,
            timing=timing,
            prompt_tokens=usage.get("prompt_tokens") if usage else None,
            cached_tokens=cached_tokens(usage, timing),
            start=start,
            end=end,
            frame_times=times,
        )


def cached_tokens(usage: dict | None, timing: dict | None) -> int | None:
    """Cached prompt tokens as the server reports them: OpenAI's ``usage.prompt_tokens_details.cached_tokens``
    (vLLM), else saker's ``timing.cached_prompt_tokens``; None when it reports neither."""
    details = (usage or {}).get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    if value is None:
        value = (timing or {}).get("cached_prompt_tokens")
    return int(value) if isinstance(value, (int, float)) else None


def _header_timing(resp) -> dict | None:
    names = {
        "queue_ms": "X-Saker-Queue-Ms",
        "prefill_ms": "X-Saker-Prefill-Ms",
        "decode_ms": "X-Saker-Decode-Ms",
        "cached_prompt_tokens": "X-Saker-Cached-Prompt-Tokens",
    }
    out = {}
    for key, header in names.items():
        value = resp.getheader(header)
        if value is not None:
            with contextlib.suppress(ValueError):
                out[key] = float(value)
    return out or None


def closed_loop(
    client: Client,
    make_body: Callable[[int, int], dict],
    clients: int,
    per_client: int,
    seconds: float | None = None,
    path: str = "/v1/completions",
) -> tuple[list[Reply], float]:
    """``clients`` threads, each sending requests back to back (``per_client`` of them, fewer if ``seconds`` run
    out) to ``path``; returns the replies and the wall time from the first send to the last answer."""
    replies: list[Reply] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients)
    deadline = [math.inf]

    def run(i: int) -> None:
        try:
            client._connection()  # connect before the clock starts
            barrier.wait()
            if i == 0:
                deadline[0] = time.perf_counter() + (seconds or math.inf)
            for j in range(per_client):
                if j and time.perf_counter() > deadline[0]:
                    break
                rejected = 0
                while True:
                    try:
                        reply = client.complete(make_body(i, j), path)
                        break
                    except HTTPError as exc:  # overloaded: count it, wait as told (at most 1 s), try again
                        if exc.status not in (429, 503) or rejected >= 20:
                            raise
                        rejected += 1
                        time.sleep(min(exc.retry_after or 0.2, 1.0))
                reply.rejected = rejected
                reply.index = (i, j)
                with lock:
                    replies.append(reply)
        except BaseException as exc:
            errors.append(exc)
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.abort()
        finally:
            client.close()

    threads = [threading.Thread(target=run, args=(i,), name=f"bench-client-{i}") for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    wall = max(r.end for r in replies) - min(r.start for r in replies)
    return replies, wall
