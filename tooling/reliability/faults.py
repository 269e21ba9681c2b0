"""Injected faults for the reliability run's ``wedge`` section (reliability only, never imported by the server
itself): importing this module patches ``ModelRunner.inject``, the runner's test-only fault hook, so that each
call (the points "rows", "flat" and "sample" of every step) raises with the probability written in the file named
by ``RELIABILITY_FAULT_FILE`` (a float 0-1; a missing, empty or unreadable file is 0). The engine then fails the
requests that step touched and serves on (app/engine/core/scheduler.py, ``_recover``).

With ``SAKER_ENGINE_PROCESS`` the steps run in the engine process, a fresh interpreter: ``engine_main`` below
replaces the engine process's entry, so the process imports this module (and so the patch) first
(multiprocessing pickles a function by its module and name). ``tooling/reliability/faulty_wsgi.py`` is the gunicorn
entry that imports it before the app is built."""

from __future__ import annotations

import os
import random

from app.engine.core import engine_process

from app.engine.model import runner
from tooling.reliability.plan import FAULT_FILE

_rng = random.Random()


def fault_rate() -> float:
    """The probability in the file named by ``RELIABILITY_FAULT_FILE`` (0 when there is none)."""
    path = os.environ.get(FAULT_FILE)
    if not path:
        return 0.0
    try:
        with open(path) as f:
            return min(1.0, max(0.0, float(f.read().strip() or 0)))
    except (OSError, ValueError):
        return 0.0


class InjectedFault(RuntimeError):
    """The failure the reliability run injects into an engine step."""


def _inject(self, point: str) -> None:
    rate = fault_rate()
    if rate and _rng.random() < rate:
        raise InjectedFault(f"injected fault at {point!r} (p = {rate:g}, {FAULT_FILE})")


_engine_main = engine_process.engine_main


def engine_main(settings, conn) -> None:
    """The engine process's loop, with this module (and so the patch) imported in it."""
    _engine_main(settings, conn)


runner.ModelRunner.inject = _inject
engine_process.engine_main = engine_main
