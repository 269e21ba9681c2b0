"""The errors gunicorn answers itself, before a request reaches the app (a malformed request line, bad or
duplicate Content-Length, Content-Length with Transfer-Encoding, headers over its limits: 400, 414, 431, 501...),
in the OpenAI error shape instead of its HTML page, so that every error a client sees is JSON.

gunicorn has no hook for this: ``install()`` replaces ``gunicorn.util.write_error``, the one function its workers
call to write such an answer (``Worker.handle_error``). gunicorn.conf.py calls it; workers inherit it at fork.
"""

from __future__ import annotations

import json

_CODES = {
    400: "invalid_request",
    403: "forbidden",
    414: "request_line_too_long",
    431: "request_headers_too_large",
    417: "expectation_failed",
    501: "not_implemented",
}


def write_json_error(sock, status_int: int, reason: str, mesg: str) -> None:
    """What gunicorn would write, as ``{"error": {...}}`` (the connection closes after it, as gunicorn's does)."""
    from gunicorn import util

    kind = "invalid_request_error" if status_int < 500 else "server_error"
    message = f"{reason}: {mesg}" if mesg else reason
    body = json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": _CODES.get(status_int, "protocol_error")}}
    ).encode()
    head = (
        f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode("latin-1")
    util.write_nonblock(sock, head + body)


def install() -> None:
    import gunicorn.util

    gunicorn.util.write_error = write_json_error
