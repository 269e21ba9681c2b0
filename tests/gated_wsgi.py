"""gunicorn entry point for tests: ``wsgi:app`` whose decode steps wait while the file named by
``TEST_DECODE_GATE`` exists, so a test can hold requests in flight (and let them go) without timing; with
``TEST_DECODE_COUNT`` each step also adds a line to that file (how many steps ran)."""

import os
import time

from app.engine import runner

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


runner.ModelRunner.rows_step = _gated_decode

from wsgi import app  # noqa: E402,F401 - after the patch
