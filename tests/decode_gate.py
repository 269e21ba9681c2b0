"""The decode gate of tests/gated_wsgi.py, imported for its patch: every decode step waits while the file named by
``TEST_DECODE_GATE`` exists, so a test can hold requests in flight (and let them go) without timing; with
``TEST_DECODE_COUNT`` each step also adds a line to that file (how many steps ran).

With ``SAKER_ENGINE_PROCESS`` the steps run in the engine process, a fresh interpreter: the process is started
with ``engine_main`` below, which imports this module there first (multiprocessing pickles a function by module
and name), so the gate holds the engine's steps too."""

import os
import time

from app.engine import engine_process, runner

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


runner.ModelRunner.rows_step = _gated_decode
engine_process.engine_main = engine_main
