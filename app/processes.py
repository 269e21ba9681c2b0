"""Stopping the servers the bench, the reliability run and the replica bench start (gunicorn, nginx): each runs in
a session of its own, so its whole process group can be signalled."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30, *, group: bool = True) -> None:
    """``sig`` to the process group (``group``) or to the process alone, then SIGKILL to the group once
    ``timeout`` seconds have passed."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
