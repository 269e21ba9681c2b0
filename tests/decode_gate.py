"""The gates of tests/gated_wsgi.py, imported for their patch: every decode-only step waits while the file named by
``TEST_DECODE_GATE`` exists, and every step that computes prompt tokens (``ModelRunner.flat_step``: a prompt's
chunk alone, or riding with decoding rows) waits while the file named by ``TEST_PREFILL_GATE`` exists, so a test can
hold requests at that point (and let them go) without timing. While a step is held, the file ``<gate>.held`` exists
(a test waits for it to know the engine is there). With ``TEST_DECODE_COUNT`` each decode-only step also adds a line
to that file (how many steps ran); with ``TEST_PREFILL_COUNT`` each prompt step adds its number of tokens (which
prompts and rows shared it). While the file named by ``TEST_FAULT_FILE`` exists, every sampling of a step fails (the
runner's test-only fault hook): ``fail`` in it is a failed step the engine recovers from, ``fatal`` one whose
recovery finds the state inconsistent (the engine stops and the worker is replaced).

With ``SAKER_ENGINE_PROCESS`` the steps run in the engine process, a fresh interpreter: the process is started
with ``engine_main`` below, which imports this module there first (multiprocessing pickles a function by module
and name), so the gates hold the engine's steps too."""

import contextlib
import os
import time

from app.engine.core import engine_process, scheduler

from app.engine.model import runner

_decode = runner.ModelRunner.rows_step
_flat = runner.ModelRunner.flat_step


def _hold(name: str) -> None:
    """Wait while the gate file named by environment variable ``name`` exists (``<gate>.held`` meanwhile)."""
    gate = os.environ.get(name)
    if not gate or not os.path.exists(gate):
        return
    held = gate + ".held"
    with open(held, "w"):
        pass
    try:
        while os.path.exists(gate):
            time.sleep(0.01)
    finally:
        with contextlib.suppress(FileNotFoundError):  # (replicas may share one gate)
            os.unlink(held)


def _gated_decode(self, *args, **kwargs):
    _hold("TEST_DECODE_GATE")
    count = os.environ.get("TEST_DECODE_COUNT")
    if count:
        with open(count, "a") as f:
            f.write("step\n")
    return _decode(self, *args, **kwargs)


def _gated_flat(self, tokens, *args, **kwargs):
    _hold("TEST_PREFILL_GATE")
    count = os.environ.get("TEST_PREFILL_COUNT")
    if count:
        with open(count, "a") as f:
            f.write(f"{tokens.numel()}\n")
    return _flat(self, tokens, *args, **kwargs)


_engine_main = engine_process.engine_main


def engine_main(settings, conn) -> None:
    """The engine process's loop, with this module (and so the gates) imported in it."""
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
runner.ModelRunner.flat_step = _gated_flat
runner.ModelRunner.inject = _inject
scheduler.Scheduler.inconsistency = _inconsistent
engine_process.engine_main = engine_main
