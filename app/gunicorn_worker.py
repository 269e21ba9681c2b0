"""The gunicorn worker saker runs: gthread, except that a request's head (and a body of announced length, up to
the body limit) is read by the worker's main loop, without blocking, before a thread takes the request; and that
a stopping worker closes its listening sockets, so that new connections are refused rather than left hanging.

Why: a gthread thread that starts on a connection reads the request head with blocking reads, so ~50 clients
that send one header line every few seconds hold all the threads and nobody else is answered (slowloris). Here a
connection costs no thread until its request is in; one that takes longer than ``head_timeout`` seconds to send
it is answered 408 (JSON) and closed. nginx in front does the same buffering (deploy/nginx); this makes the
direct exposure safe too.

What is not buffered: TLS connections (gunicorn's ``certfile``: the bytes are encrypted until a thread does the
handshake), HTTP/2 prior-knowledge peers, chunked bodies (the head is buffered; the body is read by the
thread, against the body limit) and bodies sent after ``Expect: 100-continue``. This relies on gthread's
internals (gunicorn is pinned in requirements.txt); tests/live/test_slow_clients.py holds it to its promise.
"""

from __future__ import annotations

import errno
import json
import re
import selectors
import threading
import time
from collections import deque
from functools import partial

from gunicorn.http2 import negotiation
from gunicorn.workers.gthread import ThreadWorker

HEAD_TIMEOUT = 10.0  # seconds a client has to send its request head (and announced body)
_HEAD_END = b"\r\n\r\n"
_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*([0-9]{1,12})[ \t]*\r\n", re.IGNORECASE)
_CONTINUE = re.compile(rb"\r\nexpect:[ \t]*100-continue", re.IGNORECASE)


def _request_timeout_answer() -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": f"the request was not received within {HEAD_TIMEOUT:g} seconds",
                "type": "invalid_request_error",
                "param": None,
                "code": "request_timeout",
            }
        }
    ).encode()
    return (
        b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    ) + body


class BufferingThreadWorker(ThreadWorker):
    def init_process(self):
        self.receiving: deque = deque()  # connections whose request is still coming, oldest first
        # a request's head is at most gunicorn's request line + header limits; a body is buffered up to the
        # app's body limit (a larger one is refused by the app from its Content-Length before it is read)
        self.head_limit = (
            self.cfg.limit_request_line + self.cfg.limit_request_fields * (self.cfg.limit_request_field_size + 2) + 4
        )
        from app.settings import load_settings

        settings = load_settings()
        self.body_limit = settings.max_request_bytes
        self.drain_seconds = settings.drain_seconds
        self._stop_once = threading.Lock()
        self._quit_once = threading.Lock()
        super().init_process()

    def handle_exit(self, sig, frame):
        """SIGTERM: not ready at once (``/readyz`` answers 503), still serving for SAKER_DRAIN_SECONDS so that
        routers and Kubernetes take the replica out first, then stop accepting and let in-flight requests finish
        (within the graceful timeout, which the drain counts against).

        Once only: the master relays SIGTERM to a signalled process group, and that second signal can arrive while
        this handler is still running (Python runs a handler between any two bytecodes of another), so the first
        thing done is a non-blocking acquire that no second call can pass."""
        from app import lifecycle

        if not self._stop_once.acquire(blocking=False):
            return None
        lifecycle.draining.set()
        if self.drain_seconds > 0 and self.alive:
            self.log.info("draining: not ready, stopping in %g s", self.drain_seconds)
            timer = threading.Timer(self.drain_seconds, ThreadWorker.handle_exit, args=(self, sig, None))
            timer.daemon = True
            timer.start()
            return None
        return super().handle_exit(sig, frame)

    def handle_quit(self, sig, frame):
        """SIGINT/SIGQUIT: stop now. Once: a second one (the master relays the signal to a signalled process group)
        would re-enter the thread pool's shutdown and deadlock on its lock."""
        if not self._quit_once.acquire(blocking=False):
            return None
        return super().handle_quit(sig, frame)

    def set_accept_enabled(self, enabled):
        """A stopping worker also closes its listening sockets: once every worker has (the master closed its own
        first), new connections are refused at once instead of waiting in the backlog for a worker that will
        never accept them."""
        super().set_accept_enabled(enabled)
        if not enabled and not self.alive:
            for listener in self.sockets:
                listener.close()

    # -- the main loop's side ---------------------------------------------------------------------------------
    def enqueue_req(self, conn):
        if (
            getattr(conn, "saker_received", None) is not None
            or not self._buffers(conn)
            or (conn.parser is not None and conn.parser.unreader.buf.getvalue())
        ):
            return super().enqueue_req(conn)
        conn.saker_buffer = bytearray()
        conn.saker_deadline = time.monotonic() + HEAD_TIMEOUT
        conn.sock.setblocking(False)
        self.receiving.append(conn)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_bytes, conn))

    def _buffers(self, conn) -> bool:
        return (
            not self.cfg.is_ssl and not conn.is_http2 and not negotiation.prior_knowledge_allowed(self.cfg, conn.client)
        )

    def _on_bytes(self, conn, sock):
        try:
            data = sock.recv(65536)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                return
            data = b""
        if not data:  # the client went away before its request was in
            self._drop(conn)
            return
        conn.saker_buffer += data
        if self._complete(conn.saker_buffer):
            self.poller.unregister(sock)
            self.receiving.remove(conn)
            conn.saker_received = bytes(conn.saker_buffer)
            conn.saker_buffer = None
            conn.data_ready = True
            super().enqueue_req(conn)

    def _complete(self, buffer: bytearray) -> bool:
        """Whether the request is in: its head, and the body its Content-Length announces (when within the body
        limit and not awaiting 100-continue). Past the head limit the thread takes it (gunicorn answers 431/414)."""
        end = buffer.find(_HEAD_END)
        if end < 0:
            # a head ended by bare LFs (RFC 9112 lets a recipient take LF alone as a line end): gunicorn's parser
            # gets it now and answers it (its own verdict on the line ends), instead of a 408 after the timeout
            return buffer.find(b"\n\n") >= 0 or len(buffer) > self.head_limit
        head = bytes(buffer[: end + 2])
        length = _LENGTH.search(head)
        if length is None or _CONTINUE.search(head):
            return True
        size = int(length.group(1))
        return size > self.body_limit or len(buffer) >= end + 4 + size

    def _drop(self, conn, answer: bytes | None = None):
        try:
            self.poller.unregister(conn.sock)
        except (OSError, KeyError, ValueError):
            pass
        try:
            self.receiving.remove(conn)
        except ValueError:
            pass
        if answer:
            try:
                conn.sock.setblocking(True)
                conn.sock.settimeout(1.0)
                conn.sock.sendall(answer)
            except OSError:
                pass
        self.nr_conns -= 1
        conn.close()

    def murder_pending(self):
        """Connections whose request did not come in time: 408 and closed (then gthread's own pending ones)."""
        now = time.monotonic()
        while self.receiving and self.receiving[0].saker_deadline <= now:
            self._drop(self.receiving[0], _request_timeout_answer())
        super().murder_pending()

    # -- the thread's side ------------------------------------------------------------------------------------
    def handle(self, conn):
        received = getattr(conn, "saker_received", None)
        if received is not None:
            conn.saker_received = None
            conn.sock.setblocking(True)
            conn.init()
            conn.parser.unreader.unread(received)
        return super().handle(conn)
