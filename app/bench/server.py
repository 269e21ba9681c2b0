"""Our server under gunicorn, started and stopped by the bench: ``gunicorn -c gunicorn.conf.py wsgi:app`` on
127.0.0.1 with the generated model, in a process group of its own."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from app.bench.plan import ROOT
from app.processes import stop_process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def settings_fields() -> set[str]:
    from app.settings import Settings

    return set(Settings.model_fields)


class Server:
    """gunicorn -c gunicorn.conf.py wsgi:app on 127.0.0.1, in its own process group (stopped with it)."""

    def __init__(self, model_dir: Path, name: str, env: dict[str, str], log_dir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        self.env = {
            "SAKER_MODEL": str(model_dir),
            "SAKER_SERVED_MODEL_NAME": name,
            "SAKER_LOG_LEVEL": "warning",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **env,
        }
        gunicorn = str(Path(sys.executable).parent / "gunicorn")
        # the bench's private server on 127.0.0.1 needs no API keys (the bench would not know them)
        inherited = {k: v for k, v in os.environ.items() if k.upper() not in ("SAKER_API_KEYS", "SAKER_API_KEY_FILE")}
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"gunicorn-{name}-{self.port}.log"
        self.log = open(self.log_path, "w+")
        self.proc = subprocess.Popen(
            [gunicorn, "-c", "gunicorn.conf.py", "-b", f"127.0.0.1:{self.port}", "wsgi:app"],
            cwd=ROOT,
            env={**inherited, **self.env},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited {self.proc.returncode}:\n{self.output()[-3000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=2) as sock:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    if sock.recv(64).startswith(b"HTTP/1.1 200"):
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"gunicorn not ready after {timeout:.0f} s:\n{self.output()[-3000:]}")

    def worker_pids(self) -> list[int]:
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
            return [int(c) for c in children]
        except OSError:
            return []

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30) -> None:
        stop_process(self.proc, signal.SIGTERM, timeout)
        if not self.log.closed:
            self.log.close()
