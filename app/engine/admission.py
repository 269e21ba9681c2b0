"""Admission to the model: at most ``capacity`` requests run at once, at most ``max_queue`` wait for their
turn, and none waits longer than ``timeout`` seconds.

The worker wraps each request in ``with admission.slot():``. A request that finds the queue full gets
``QueueFull`` at once; one that waits too long gets ``QueueTimeout`` (both with a retry estimate; the HTTP layer
answers 429 and 503 with Retry-After).
Waiters are served first come, first served. The worker sets ``capacity`` to SAKER_MAX_RUNNING_REQUESTS: that
many requests are handed to the scheduler at once, the rest wait here.
No torch and no Flask here.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import time
from typing import Iterator

from app.engine.errors import QueueFull, QueueTimeout

_RETRY_MIN_S, _RETRY_MAX_S = 1, 60


class _Waiter:
    """A request waiting in the queue for a slot; ``granted`` once a releaser hands it one."""

    __slots__ = ("granted",)

    def __init__(self):
        self.granted = False


class Admission:
    def __init__(self, max_queue: int | None = None, timeout: float | None = None, capacity: int = 1):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        if max_queue is not None and max_queue < 0:
            raise ValueError("max_queue must be >= 0 or None (unbounded)")
        if timeout is not None and timeout <= 0:
            raise ValueError("timeout must be > 0 or None (wait forever)")
        self.max_queue = max_queue  # None: unbounded
        self.timeout = timeout  # None: wait as long as it takes
        self.capacity = capacity
        self.active = 0  # requests holding a slot
        self.waiting = 0  # requests waiting for one
        self.rejected = 0  # turned away because the queue was full
        self.timed_out = 0  # gave up waiting
        self._mean_hold_s: float | None = None
        self._cond = threading.Condition()
        self._waiters: collections.deque[_Waiter] = collections.deque()  # first come, first served

    # -- the seam -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """Hold one slot for the body of the ``with``; raises before the body when it cannot get one."""
        self.acquire()
        start = time.monotonic()
        try:
            yield
        finally:
            self.release(time.monotonic() - start)

    def acquire(self) -> None:
        with self._cond:
            if self.active < self.capacity and not self._waiters:
                self.active += 1
                return
            if self.max_queue is not None and self.waiting >= self.max_queue:
                self.rejected += 1
                raise QueueFull(self.waiting, self.max_queue, self.retry_after_s())
            waiter = _Waiter()
            self._waiters.append(waiter)
            self.waiting = len(self._waiters)
            queued = time.monotonic()
            deadline = None if self.timeout is None else queued + self.timeout
            while not waiter.granted:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    self._waiters.remove(waiter)
                    self.waiting = len(self._waiters)
                    self.timed_out += 1
                    raise QueueTimeout(time.monotonic() - queued, self.timeout, self.retry_after_s())
                self._cond.wait(remaining)
            # the releaser handed its slot over: ``active`` already counts this request

    def release(self, held_s: float = 0.0) -> None:
        """Free a slot, or hand it straight to the longest waiter: the queue shrinks in the same step, so a
        request arriving meanwhile never sees a full queue that is about to move (and never jumps it)."""
        with self._cond:
            self._mean_hold_s = held_s if self._mean_hold_s is None else 0.8 * self._mean_hold_s + 0.2 * held_s
            if self._waiters:
                self._waiters.popleft().granted = True
                self.waiting = len(self._waiters)
                self._cond.notify_all()
            else:
                self.active -= 1

    # -- what clients and metrics read --------------------------------------------------------------------
    def retry_after_s(self) -> int:
        """Seconds until a retry has a fair chance: the queue ahead times the mean service time, 1..60."""
        mean = self._mean_hold_s or 1.0
        estimate = mean * (self.waiting + 1) / self.capacity
        return int(min(_RETRY_MAX_S, max(_RETRY_MIN_S, math.ceil(estimate))))

    def snapshot(self) -> dict[str, int]:
        with self._cond:
            return {
                "active": self.active,
                "waiting": self.waiting,
                "rejected": self.rejected,
                "timed_out": self.timed_out,
            }
