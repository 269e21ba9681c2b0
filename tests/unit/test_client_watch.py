"""Knowing that a client left (app/client_watch.py) and cancelling its request at once (client.Ticket): no model."""

import socket
import threading

import pytest

from app.client_watch import ClientConnection, ClientWatcher


def settled(watcher: ClientWatcher) -> None:
    """Wait (on events, no clock) until the watcher thread has handled everything that was ready before this call:
    a fresh socket's close is reported by a poll no earlier than anything ready now (epoll reports every ready
    socket at once), and a second one's by a poll after the first one's callbacks have all run."""
    for _ in range(2):
        ours, theirs = socket.socketpair()
        done = threading.Event()
        watcher.watch(ours, done.set)
        theirs.close()
        assert done.wait(60)
        ours.close()


def test_the_watcher_calls_back_once_when_the_peer_closes():
    watcher = ClientWatcher()
    ours, theirs = socket.socketpair()
    called = threading.Event()
    calls = []
    watcher.watch(ours, lambda: (calls.append(1), called.set()))
    connection = ClientConnection(ours, watcher)
    assert connection()  # nothing to read: still there
    theirs.close()
    assert called.wait(10)
    assert not connection()  # readable with nothing to read: gone
    settled(watcher)  # the closed socket stays readable: a watcher that kept it would have called again by now
    assert calls == [1] and watcher.watched == 0
    ours.close()


def test_pipelined_bytes_are_not_a_close_and_unwatching_stops_the_callback():
    watcher = ClientWatcher()
    ours, theirs = socket.socketpair()
    called = threading.Event()
    unwatch = watcher.watch(ours, called.set)
    theirs.sendall(b"GET /next HTTP/1.1\r\n")  # the next request of a kept-alive connection
    settled(watcher)  # the bytes were there before: had they counted as a close, the callback would have run
    assert not called.is_set()
    assert ClientConnection(ours, watcher)()
    unwatch()
    assert watcher.watched == 0
    theirs.close()
    settled(watcher)
    assert not called.is_set()
    ours.close()


def test_a_woken_ticket_asks_its_client_at_once_and_cancels():
    """With polling out of the picture (a poll interval of an hour), only the watcher's wake-up can end the
    wait: the reader raises ClientGone and the request's groups are cancelled."""
    from types import SimpleNamespace

    from app.engine.core.client import Ticket
    from app.engine.errors import ClientGone

    group = SimpleNamespace(tag=0, cancelled=False)

    class Engine:  # the engine side: an abort cancels the request's groups
        def abort(self, rid):
            assert rid == 7
            group.cancelled = True

    ticket = Ticket(Engine(), 7, [], eager=True)
    ticket.groups, ticket._open = [group], 1
    there = [True]
    woken = {}

    class Alive:
        def __call__(self):
            return there[0]

        def watch(self, callback):
            woken["callback"] = callback
            return lambda: woken.pop("callback", None)

    ticket.watch_client(Alive())
    ticket.POLL_S = 3600
    outcome = {}

    def read():
        try:
            list(ticket)
        except ClientGone as exc:
            outcome["error"] = exc

    waiting = threading.Event()

    class Events:  # the ticket's queue, telling when the reader waits on it
        def __init__(self, inner):
            self.inner = inner

        def get(self, *args, **kwargs):
            waiting.set()
            return self.inner.get(*args, **kwargs)

        def put(self, item):
            self.inner.put(item)

    ticket._events = Events(ticket._events)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert waiting.wait(10)  # the reader is waiting for events (no clock: told by the queue)
    assert reader.is_alive()
    there[0] = False
    woken["callback"]()
    reader.join(10)
    assert not reader.is_alive() and "error" in outcome and group.cancelled
    ticket.unwatch_client()
    assert "callback" not in woken


@pytest.mark.skipif(not hasattr(socket, "SO_REUSEPORT"), reason="POSIX sockets")
def test_a_half_closed_client_counts_as_gone():
    """A client that shuts down its sending side after its request looks like one that left (nginx's default
    too): documented in docs/api.md."""
    watcher = ClientWatcher()
    ours, theirs = socket.socketpair()
    called = threading.Event()
    watcher.watch(ours, called.set)
    theirs.shutdown(socket.SHUT_WR)
    assert called.wait(10)
    assert not ClientConnection(ours, watcher)()
    ours.close()
    theirs.close()
