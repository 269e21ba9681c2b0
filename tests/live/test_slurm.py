"""deploy/slurm/saker.sbatch run for real on 127.0.0.1, as Slurm would run it but without Slurm: it starts
gunicorn, prints its address, answers, and stops on SIGTERM. Its header is checked in
tests/unit/test_deploy_files.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import requests

from servers import ROOT, free_port

SBATCH = ROOT / "deploy" / "slurm" / "saker.sbatch"


@pytest.mark.slow
def test_slurm_script_starts_the_server_and_prints_its_address(gpt2_dir):
    """Run the batch script as Slurm would (without Slurm): it starts gunicorn, waits for /health and prints
    the address; SIGTERM (scancel) stops it cleanly."""
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("SAKER_", "SLURM_"))},
        "SAKER_MODEL": str(gpt2_dir),
        "SAKER_SERVED_MODEL_NAME": "tiny-gpt2",
        "HF_HUB_OFFLINE": "1",
        "PORT": str(port),
        "BIND_HOST": "127.0.0.1",
        "VENV": str(Path(sys.executable).parent.parent),
        "READY_TIMEOUT": "120",
    }
    proc = subprocess.Popen(
        ["bash", str(SBATCH)],
        cwd="/",
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = []
    drain = None
    try:
        for line in proc.stdout:
            lines.append(line)
            if "saker: ready at" in line or "saker: not ready" in line:
                break
        ready = next((line for line in lines if "saker: ready at" in line), None)
        assert ready is not None, "".join(lines)
        drain = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # the pipe never fills
        drain.start()
        assert ready.strip() == f"saker: ready at http://127.0.0.1:{port}/v1"
        answer = requests.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=60,
            json={"model": "tiny-gpt2", "prompt": "Hello", "max_tokens": 2},
        )
        assert answer.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if drain is not None:
            drain.join(30)  # it reads to the pipe's end: the script and its gunicorn are gone
        proc.stdout.close()
