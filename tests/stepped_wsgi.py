"""gunicorn entry point for the web page's browser tests (tests/live/test_page.py): ``wsgi:app`` whose decode steps
can be held and then let through one at a time, so that a test sees a stream half-way without timing.

With ``TEST_STEP_GATE`` naming a folder: while the file ``hold`` exists there, every decode step (the engine's
``rows_step``) waits for a permit, a file ``permit-*`` in that folder, takes it (removes it) and runs; without
``hold`` steps run freely. A prompt's prefill is not held, but the iteration that ends it also runs the batch's
decode step before its tokens go out, so one permit lets a new stream's first tokens out and the next step waits.
In-process engine only (the default; not ``SAKER_ENGINE_PROCESS``). tests/gated_wsgi.py is the all-or-nothing
gate the other live tests use."""

import os
import time
from pathlib import Path

from app.engine.model import runner

_rows_step = runner.ModelRunner.rows_step


def _take_a_permit(gate: Path) -> None:
    while (gate / "hold").exists():
        for permit in sorted(gate.glob("permit-*")):
            try:
                permit.unlink()
                return
            except FileNotFoundError:  # taken by another step between the listing and now
                continue
        time.sleep(0.005)


def _stepped(self, *args, **kwargs):
    folder = os.environ.get("TEST_STEP_GATE")
    if folder:
        _take_a_permit(Path(folder))
    return _rows_step(self, *args, **kwargs)


runner.ModelRunner.rows_step = _stepped

from wsgi import app  # noqa: E402, F401 - after the patch
