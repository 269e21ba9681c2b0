"""The server a reliability run measures: saker under gunicorn on 127.0.0.1 (``tooling.processes.GunicornServer``),
its log and saker's JSON access log in files next to the report, its workers' RSS."""

from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path

from tooling.processes import GunicornServer, free_port, without_api_keys


class Server(GunicornServer):
    """gunicorn -c gunicorn.conf.py wsgi:app on 127.0.0.1 in its own process group, serving ``model_dir`` as
    ``name``; its log (and saker's JSON access log) in files under ``log_dir``. The caller's API keys stay out:
    this private server needs none (we would not know them). ``app`` is the WSGI entry (``wsgi:app``; the wedge
    section's second server: ``tooling.reliability.faulty_wsgi:app``)."""

    def __init__(self, model_dir: Path, name: str, env: dict[str, str], log_dir: Path, app: str = "wsgi:app"):
        port = free_port()
        self.served_name = name
        self.access_path = Path(log_dir) / f"access-{port}.log"
        super().__init__(
            {
                "SAKER_MODEL": str(model_dir),
                "SAKER_SERVED_MODEL_NAME": name,
                "SAKER_LOG_LEVEL": "info",
                "SAKER_ACCESS_LOG": str(self.access_path),
                **env,
            },
            log_dir=log_dir,
            inherit=without_api_keys,
            port=port,
            app=app,
        )

    def wait_ready(self, timeout: float = 600, path: str | None = None) -> float:
        return super().wait_ready(timeout, path)

    def rss_bytes(self) -> int:
        """VmRSS of the workers and their children (an engine process)."""
        total = 0
        for pid in self.worker_pids():
            with contextlib.suppress(OSError, ValueError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        return total

    def access_lines(self) -> list[dict]:
        if not self.access_path.exists():
            return []
        out = []
        for line in self.access_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60, *, group: bool = True) -> int | None:
        return super().stop(sig, timeout, group=group)
