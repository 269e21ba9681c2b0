"""Knowing at once that a client has gone: one thread per process watches the sockets of the requests in flight.

A request's thread waits for engine events; between them it asks its socket whether the client is still there
(``ClientConnection.__call__``: readable with nothing to read means closed). Asking costs nothing, but only
happens every ``Ticket.POLL_S``; so the socket is also registered with an epoll set for ``EPOLLRDHUP`` (the peer
closed or shut down its side), and the watcher thread wakes the request's thread as soon as that happens. The
request is then cancelled before the model's next step. A client that only half-closes (``shutdown(SHUT_WR)``
after sending its request) looks the same as one that left: it is treated as gone, as nginx does by default.

Where epoll does not exist (not Linux) the polling alone remains. No torch and no Flask here.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
from typing import Callable

log = logging.getLogger(__name__)


class ClientWatcher:
    """The process's epoll set of client sockets and the thread that calls their callbacks once each."""

    def __init__(self):
        self._lock = threading.Lock()
        self._epoll = None
        self._callbacks: dict[int, Callable[[], None]] = {}

    def watch(self, sock: socket.socket, on_close: Callable[[], None]) -> Callable[[], None] | None:
        """Call ``on_close`` (on the watcher thread) when the peer closes; returns the function that stops
        watching (call it before the socket is closed or reused), or None where nothing can watch (no epoll)."""
        if not hasattr(select, "epoll"):
            return None
        fd = sock.fileno()
        if fd < 0:
            return None
        with self._lock:
            if self._epoll is None:
                self._epoll = select.epoll()
                threading.Thread(target=self._run, name="saker-client-watch", daemon=True).start()
            self._callbacks[fd] = on_close
            try:
                self._epoll.register(fd, select.EPOLLRDHUP)
            except FileExistsError:
                self._epoll.modify(fd, select.EPOLLRDHUP)

        def unwatch() -> None:
            with self._lock:
                if self._callbacks.get(fd) is on_close:
                    del self._callbacks[fd]
                    try:
                        self._epoll.unregister(fd)
                    except (OSError, ValueError):
                        pass

        return unwatch

    @property
    def watched(self) -> int:
        return len(self._callbacks)

    def _run(self) -> None:
        while True:
            try:
                ready = self._epoll.poll()
            except InterruptedError:
                continue
            for fd, _ in ready:
                with self._lock:
                    callback = self._callbacks.pop(fd, None)
                    try:
                        self._epoll.unregister(fd)
                    except (OSError, ValueError):
                        pass
                if callback is not None:
                    try:
                        callback()
                    except Exception:
                        log.exception("saker: a client-close callback failed")


WATCHER = ClientWatcher()


class ClientConnection:
    """The client end of one request: call it to ask whether the client is still connected; ``watch`` to be told
    when it leaves."""

    def __init__(self, sock: socket.socket, watcher: ClientWatcher = WATCHER):
        self.sock = sock
        self.watcher = watcher

    def __call__(self) -> bool:
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
            return not readable or bool(self.sock.recv(1, socket.MSG_PEEK))
        except (OSError, ValueError):
            return False

    def watch(self, on_close: Callable[[], None]) -> Callable[[], None] | None:
        return self.watcher.watch(self.sock, on_close)
