"""gunicorn entry point for tests: ``wsgi:app`` whose decode steps wait while the file named by
``TEST_DECODE_GATE`` exists and whose prompt steps wait while the one named by ``TEST_PREFILL_GATE`` exists, so a
test can hold requests in flight (and let them go) without timing; with ``TEST_DECODE_COUNT`` each decode step also
adds a line to that file (how many steps ran). The gates are tests/decode_gate.py (also in the engine process, with
``SAKER_ENGINE_PROCESS``)."""

import decode_gate  # noqa: F401 - the patch, before the app is built

from wsgi import app  # noqa: F401 - after the patch
