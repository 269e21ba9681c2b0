"""A real gunicorn on 127.0.0.1 for integration tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from app.processes import GunicornServer, free_port, stop_process

ROOT = Path(__file__).resolve().parent.parent
__all__ = ["ROOT", "Gunicorn", "Nginx", "free_port", "nginx_binary", "read_response"]


class Gunicorn(GunicornServer):
    """The tests' gunicorn: ``env`` over the test process's environment, its log under ``.cache/``."""

    def __init__(self, env: dict[str, str], args: tuple[str, ...] = (), app: str = "wsgi:app"):
        super().__init__(env, log_dir=ROOT / ".cache", args=args, app=app)

    def wait_ready(self, timeout: float = 120, path: str | None = None) -> float:
        return super().wait_ready(timeout, path)


def read_response(sock: socket.socket, *, cut: bool = False) -> bytes:
    """One answer read off a socket by hand: its head, the blank line and its body, read until it holds the
    Content-Length (or the server closes). ``cut``: the body cut to that length (empty without one)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lengths = [line.split(b":", 1)[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
    length = int(lengths[0]) if lengths else 0
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + (body[:length] if cut else body)


def nginx_binary() -> str | None:
    """The nginx executable (Debian puts it in /usr/sbin, which is not on every user's PATH)."""
    import shutil

    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


class Nginx:
    """nginx in the foreground as the current user, with every path (pid, logs, temp files) under ``root``,
    serving ``deploy/nginx/saker.conf`` with its upstream pointed at ``upstream`` and its listener on a free
    loopback port."""

    def __init__(self, root: Path, upstream: str, site: Path = ROOT / "deploy" / "nginx" / "saker.conf"):
        import re

        self.binary = nginx_binary()
        assert self.binary, "nginx is not installed"
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        root.mkdir(parents=True, exist_ok=True)
        conf = site.read_text()
        conf, n_up = re.subn(r"server 127\.0\.0\.1:8000;", f"server {upstream};", conf)
        conf, n_listen = re.subn(r"listen 80;", f"listen 127.0.0.1:{self.port};", conf)
        assert n_up == 1 and n_listen == 1, "deploy/nginx/saker.conf changed shape"
        (root / "saker.conf").write_text(conf)
        user = ""
        if os.geteuid() == 0:  # workers would otherwise switch to nobody and lose the temp paths
            import grp
            import pwd

            user = f"user {pwd.getpwuid(0).pw_name} {grp.getgrgid(0).gr_name};"
        temp = "\n".join(
            f"    {name}_temp_path {root / name};" for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        (root / "nginx.conf").write_text(f"""
daemon off;
worker_processes 1;
pid {root / "nginx.pid"};
error_log {root / "error.log"} info;
{user}
events {{ worker_connections 256; }}
http {{
    access_log {root / "access.log"};
{temp}
    include {root / "saker.conf"};
}}
""")
        self.proc = subprocess.Popen(
            [self.binary, "-p", str(root), "-c", str(root / "nginx.conf"), "-e", str(root / "error.log")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def check_config(self) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                self.binary,
                "-t",
                "-p",
                str(self.root),
                "-c",
                str(self.root / "nginx.conf"),
                "-e",
                str(self.root / "error.log"),
            ],
            capture_output=True,
            text=True,
        )

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited {self.proc.returncode}: {self.output()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"nginx not listening: {self.output()}")

    def output(self) -> str:
        log = self.root / "error.log"
        return log.read_text() if log.exists() else ""

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGQUIT, 15)
        self.proc.stdout.close()  # never read (nginx logs to files); left open it is a ResourceWarning
