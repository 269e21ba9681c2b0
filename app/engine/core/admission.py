"""The rules of the scheduler's one waiting queue: at most ``capacity`` requests run at once, at most ``max_queue``
wait for their turn, and none waits longer than ``timeout`` seconds.

The scheduler (``scheduler.Scheduler``) keeps every request's prompts in one queue, in order of arrival; this
bookkeeping says which requests hold a running slot. A request that arrives to a full queue gets ``QueueFull`` at
once; one that waits too long gets ``QueueTimeout`` (both with a retry estimate; the HTTP layer answers 429 and 503
with Retry-After). Slots go first come, first served: a request that ends hands its slot to the longest waiter.
Plain bookkeeping: the scheduler calls it under its own lock, and nothing here blocks. No torch and no Flask here.
"""

from __future__ import annotations

import collections
import math

from app.engine.errors import QueueFull, QueueTimeout

_RETRY_MIN_S, _RETRY_MAX_S = 1, 60


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
        self.rejected = 0  # turned away because the queue was full
        self.timed_out = 0  # gave up waiting
        self._running: dict[int, float] = {}  # request id -> when it got its slot
        self._waiting: collections.OrderedDict[int, float] = collections.OrderedDict()  # id -> when it arrived
        self._mean_hold_s: float | None = None

    @property
    def active(self) -> int:
        """Requests holding a slot."""
        return len(self._running)

    @property
    def waiting(self) -> int:
        """Requests waiting for one."""
        return len(self._waiting)

    def arrive(self, rid: int, now: float) -> bool:
        """A new request: True when it holds a slot at once, False when it waits for one. Raises ``QueueFull`` when
        it would wait and ``max_queue`` are waiting already."""
        if len(self._running) < self.capacity and not self._waiting:
            self._running[rid] = now
            return True
        if self.max_queue is not None and len(self._waiting) >= self.max_queue:
            self.rejected += 1
            raise QueueFull(len(self._waiting), self.max_queue, self.retry_after_s())
        self._waiting[rid] = now
        return False

    def holds(self, rid: int) -> bool:
        """Whether request ``rid`` holds a running slot."""
        return rid in self._running

    def leave(self, rid: int, now: float) -> int | None:
        """Request ``rid`` ended (or left while it waited). A slot it held goes to the longest waiter, whose id is
        returned (None: no one got one)."""
        if self._waiting.pop(rid, None) is not None:
            return None
        since = self._running.pop(rid, None)
        if since is None:
            return None
        held = now - since
        self._mean_hold_s = held if self._mean_hold_s is None else 0.8 * self._mean_hold_s + 0.2 * held
        if self._waiting and len(self._running) < self.capacity:
            granted, _ = self._waiting.popitem(last=False)
            self._running[granted] = now
            return granted
        return None

    def expired(self, now: float) -> list[tuple[int, QueueTimeout]]:
        """Waiting requests past the timeout leave the queue: ``(rid, QueueTimeout)`` for each, oldest first."""
        out = []
        while self.timeout is not None and self._waiting:
            rid, since = next(iter(self._waiting.items()))
            if now - since < self.timeout:
                break
            del self._waiting[rid]
            self.timed_out += 1
            out.append((rid, QueueTimeout(now - since, self.timeout, self.retry_after_s())))
        return out

    def next_deadline(self) -> float | None:
        """When the longest waiter times out (None: no one waits, or no timeout)."""
        if self.timeout is None or not self._waiting:
            return None
        return next(iter(self._waiting.values())) + self.timeout

    # -- what clients and metrics read --------------------------------------------------------------------
    def retry_after_s(self) -> int:
        """Seconds until a retry has a fair chance: the queue ahead times the mean service time, 1..60."""
        mean = self._mean_hold_s or 1.0
        estimate = mean * (len(self._waiting) + 1) / self.capacity
        return int(min(_RETRY_MAX_S, max(_RETRY_MIN_S, math.ceil(estimate))))

    def snapshot(self) -> dict[str, int]:
        return {
            "active": len(self._running),
            "waiting": len(self._waiting),
            "rejected": self.rejected,
            "timed_out": self.timed_out,
        }
