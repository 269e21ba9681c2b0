"""Raw HTTP for the reliability run: requests built byte by byte, sent on a socket of their own (in parts, with
pauses, half-closed) and their answers read back whatever shape they come in; a plain JSON POST; the
server's Prometheus metrics."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


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
    error = None
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
        raw, failed = receive(sock)
        if failed is not None:
            error = f"{error + '; ' if error else ''}recv: {failed!r}"
    answer = parse_answer(raw)
    answer.error = error if answer.status is None else None
    answer.seconds = time.monotonic() - started
    return answer


def receive(sock: socket.socket, raw: bytes = b"") -> tuple[bytes, OSError | None]:
    """Read on after ``raw`` until the answer is complete or the server closes; what came, and the error that
    stopped the reading (None when it ended as it should)."""
    try:
        while not complete(raw):
            chunk = sock.recv(65536)
            if not chunk:
                break
            raw += chunk
    except OSError as exc:
        return raw, exc
    return raw, None


def complete(raw: bytes) -> bool:
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return False
    if head.startswith(b"HTTP/1.1 100") or head.startswith(b"HTTP/1.0 100"):
        return complete(body)
    headers = header_fields(head)
    if "content-length" in headers:
        with contextlib.suppress(ValueError):
            return len(body) >= int(headers["content-length"])
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return body.endswith(b"0\r\n\r\n")
    return False


def header_fields(head: bytes) -> dict[str, str]:
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
    headers = header_fields(head)
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = dechunk(body)
    elif "content-length" in headers:
        with contextlib.suppress(ValueError):
            body = body[: int(headers["content-length"])]
    return Answer(int(match.group(1)), headers, body)


def dechunk(data: bytes) -> bytes:
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


def hard_close(sock: socket.socket | None) -> None:
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


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
