"""SIGINT/SIGTERM during a run: ``Interrupted`` at once, except while lines are written (then after the write), so
that an output only ever holds whole lines."""

from __future__ import annotations

import contextlib
import signal
from typing import Any


class Interrupted(BaseException):
    """SIGINT/SIGTERM arrived (BaseException so that per-request ``except Exception`` does not swallow it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class SignalGuard:
    """SIGINT/SIGTERM raise ``Interrupted`` at once, except while lines are written: then after the write."""

    def __init__(self):
        self.writing = False
        self.pending: int | None = None
        self.previous: dict[int, Any] = {}

    def _handler(self, signum, frame):
        if self.writing:
            self.pending = signum
            return
        raise Interrupted(signum)

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                self.previous[signum] = signal.signal(signum, self._handler)
            except ValueError:  # not the main thread: leave signals alone
                pass

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}

    @contextlib.contextmanager
    def writing_lines(self):
        self.writing = True
        try:
            yield
        finally:
            self.writing = False
        if self.pending is not None:
            signum, self.pending = self.pending, None
            raise Interrupted(signum)
