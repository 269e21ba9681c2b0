"""Slow clients under a real gunicorn (app/gunicorn_worker.py): 200 connections that send their request head one
line every 2 s (reconnecting when answered 408) for 30 s hold no thread, while a normal client's requests keep
being answered; a request that trickles in within the time limit is served; keep-alive, pipelining and
``Expect: 100-continue`` still work."""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import pytest
import requests

import servers
from servers import Gunicorn

pytestmark = pytest.mark.slow
SLOW_CLIENTS, SECONDS = 200, 30


@pytest.fixture(scope="module")
def server(gpt2_dir):
    srv = Gunicorn({"SAKER_MODEL": str(gpt2_dir), "SAKER_SERVED_MODEL_NAME": "tiny-gpt2", "SAKER_THREADS": "32"})
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def read_response(sock) -> tuple[int, bytes]:
    head, _, body = servers.read_response(sock, cut=True).partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def test_slow_clients_do_not_starve_the_server(server):
    """The slow clients keep their heads coming (a line every 2 s) for 30 s; a normal client's requests are
    answered meanwhile. Starvation shows without a clock: with every slow connection held, a request that waited
    for a thread would be answered only after some slow head was cut (the head timeout), so the first request
    sent once all are held must be answered before any cut."""
    stop = time.time() + SECONDS  # the slow clients' script, not a bound checked
    timeouts, held = [], []
    lock = threading.Lock()

    def slow(i: int) -> None:
        while time.time() < stop:
            try:
                with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
                    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                    with lock:
                        held.append(i)
                    line = 0
                    while time.time() < stop:
                        readable, _, _ = select.select([sock], [], [], 2)  # a line every 2 s
                        if readable:  # answered (408) and closed: counted at once, then come back
                            raise ConnectionResetError
                        line += 1
                        sock.sendall(b"X-Slow-%d: 1\r\n" % line)
            except OSError:  # answered 408 and closed: come back, as an attacker would
                with lock:
                    timeouts.append(i)

    threads = [threading.Thread(target=slow, args=(i,), daemon=True) for i in range(SLOW_CLIENTS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60  # a safety net only
    while len(set(held)) < SLOW_CLIENTS:  # every slow connection in (its first line sent)
        assert time.monotonic() < deadline, f"{len(set(held))} of {SLOW_CLIENTS} slow clients connected"
        time.sleep(0.05)
    answered = []  # (status, slow heads cut while it was waited for)
    while time.time() < stop - 2:
        cut = len(timeouts)
        resp = requests.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        answered.append((resp.status_code, len(timeouts) - cut))
        assert requests.get(server.url + "/health", timeout=60).status_code == 200
        time.sleep(0.5)  # the normal client's pace
    for t in threads:
        t.join(timeout=60)
    assert len(set(held)) == SLOW_CLIENTS
    assert answered and all(status == 200 for status, _ in answered)
    assert answered[0][1] == 0, answered  # the first one waited for no slow head's cut
    assert timeouts, "slow heads are cut after the time limit"


def test_a_slow_head_is_answered_408_in_json(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and nothing more: the head never ends
        status, body = read_response(sock)
    # (a head that does end in time is served: test_a_request_that_trickles_in_in_time_is_served)
    assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"


def test_a_request_that_trickles_in_in_time_is_served(server):
    body = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
    raw = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    ) + body
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        for at in range(0, len(raw), len(raw) // 6 + 1):
            sock.sendall(raw[at : at + len(raw) // 6 + 1])
            time.sleep(0.4)
        status, answer = read_response(sock)
    assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] == 2


def test_keep_alive_pipelining_and_expect_continue(server):
    one = json.dumps({"prompt": "Hello", "max_tokens": 1}).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(one)
    ) + one
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request + request)  # two requests in one write
        assert read_response(sock)[0] == 200
        assert read_response(sock)[0] == 200
        sock.sendall(request)  # and a third on the same connection later
        assert read_response(sock)[0] == 200
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(
            request.replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n", 1).split(b"\r\n\r\n")[0] + b"\r\n\r\n"
        )
        head = sock.recv(65536)  # the head alone reaches a thread, which says continue (else: 408 at the timeout)
        assert head.startswith(b"HTTP/1.1 100"), head
        sock.sendall(one)
        status, _ = read_response(sock)
        assert status == 200
    with requests.Session() as session:
        for _ in range(3):
            assert (
                session.post(
                    server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30
                ).status_code
                == 200
            )


def test_a_head_ended_by_bare_line_feeds_is_answered_at_once(server):
    """RFC 9112 lets a recipient take a bare LF as a line end: such a head is handed to the parser when it ends
    (its verdict, whatever it is, comes at once), not held until the head timeout's 408."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\nHost: x\n\n")
        status, body = read_response(sock)
    assert status != 408, body
    assert status == 200 or json.loads(body)["error"]["type"] == "invalid_request_error", (status, body)
