"""The decode gate of tests/gated_wsgi.py, imported for its patch: every decode step waits while the file named by
``TEST_DECODE_GATE`` exists, so a test can hold requests in flight (and let them go) without timing; with
``TEST_DECODE_COUNT`` each step also adds a line to that file (how many steps ran). While the file named by
``TEST_FAULT_FILE`` exists, every sampling of a step fails (the runner's test-only fault hook): ``fail`` in it is a
failed step the engine recovers from, ``fatal`` one whose recovery finds the state inconsistent (the engine stops
and the worker is replaced).

With ``SAKER_ENGINE_PROCESS`` the steps run in the engine process, a fresh interpreter: the process is started
with ``engine_main`` below, which imports this module there first (multiprocessing pickles a function by module
and name), so the gate holds the engine's steps too."""

import os
import time

from app.engine import engine_process, runner, scheduler

_decode = runner.ModelRunner.rows_step


def _gated_decode(self, *args, **kwargs):
    gate = os.environ.get("TEST_DECODE_GATE")
    while gate and os.path.exists(gate):
        time.sleep(0.01)
    count = os.environ.get("TEST_DECODE_COUNT")
    if count:
        with open(count, "a") as f:
            f.write("step\n")
    return _decode(self, *args, **kwargs)


_engine_main = engine_process.engine_main


def engine_main(settings, conn) -> None:
    """The engine process's loop, with this module (and so the gate) imported in it."""
    _engine_main(settings, conn)


def _fault() -> str:
    path = os.environ.get("TEST_FAULT_FILE")
    try:
        with open(path) as f:
            return f.read().strip()
    except (TypeError, OSError):
        return ""


def _inject(self, point: str) -> None:
    if point == "sample" and _fault():
        raise RuntimeError(f"injected fault ({_fault()}, TEST_FAULT_FILE)")


_inconsistency = scheduler.Scheduler.inconsistency


def _inconsistent(self):
    return "the test's fault file says fatal" if _fault() == "fatal" else _inconsistency(self)


runner.ModelRunner.rows_step = _gated_decode
runner.ModelRunner.inject = _inject
scheduler.Scheduler.inconsistency = _inconsistent
engine_process.engine_main = engine_main
