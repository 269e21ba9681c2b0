"""A real gunicorn on 127.0.0.1 for integration tests."""

from __future__ import annotations

import contextlib
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tooling.processes import GunicornServer, NginxServer, free_port, nginx_binary

ROOT = Path(__file__).resolve().parent.parent
__all__ = [
    "LOGS",
    "ROOT",
    "Gunicorn",
    "Nginx",
    "free_port",
    "nginx_binary",
    "openai_client",
    "read_response",
    "running",
]


# one folder of server logs per test process, in the system's temporary directory: under .cache/ they piled up, one
# file per server started, run after run
LOGS = Path(tempfile.mkdtemp(prefix="saker-test-servers-"))


class Gunicorn(GunicornServer):
    """The tests' gunicorn: ``env`` over the test process's environment, its log in ``LOGS``."""

    def __init__(self, env: dict[str, str], args: tuple[str, ...] = (), app: str = "wsgi:app"):
        super().__init__(env, log_dir=LOGS, args=args, app=app)

    def wait_ready(self, timeout: float = 480, path: str | None = None) -> float:
        """Ready within ``timeout`` s: a start on a loaded machine (another build or benchmark on its two cores)
        took more than 120 s, and the deadline only names a server that hangs (its log in the error), so it stays
        below pytest's own 600 s limit."""
        return super().wait_ready(timeout, path)


@contextlib.contextmanager
def running(env: dict[str, str], **kwargs) -> Iterator[Gunicorn]:
    """A ``Gunicorn`` ready to serve for the body of the ``with`` (a module fixture yields from it), stopped after."""
    with Gunicorn(env, **kwargs) as srv:
        srv.wait_ready()
        yield srv


def openai_client(srv: Gunicorn):
    """The official client on ``srv``, no retries."""
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


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


class Nginx(NginxServer):
    """nginx serving ``deploy/nginx/saker.conf`` with its upstream pointed at ``upstream`` and its listener on a
    free loopback port (everything else: ``tooling.processes.NginxServer``)."""

    def __init__(self, root: Path, upstream: str, site: Path = ROOT / "deploy" / "nginx" / "saker.conf"):
        import re

        super().__init__(root)
        conf = site.read_text()
        conf, n_up = re.subn(r"server 127\.0\.0\.1:8000;", f"server {upstream};", conf)
        conf, n_listen = re.subn(r"listen 80;", f"listen 127.0.0.1:{self.port};", conf)
        assert n_up == 1 and n_listen == 1, "deploy/nginx/saker.conf changed shape"
        (root / "saker.conf").write_text(conf)
        self.start()
