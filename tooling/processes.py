"""Starting and stopping the servers that the bench, the reliability run, the replica bench and the tests run on
127.0.0.1: ``free_port``, ``GunicornServer`` (``gunicorn -c gunicorn.conf.py -b 127.0.0.1:PORT wsgi:app`` in a
session of its own, its output in a log file, waited on until ``/health`` or ``/readyz`` answers 200) and
``stop_process`` (the whole process group can be signalled). Standard library only: no torch, no Flask."""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# what a server started here never needs from the Hub (and must not wait for)
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
API_KEY_VARIABLES = ("SAKER_API_KEYS", "SAKER_API_KEY_FILE")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it; another process could still take it first)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def without_api_keys(name: str) -> bool:
    """An ``inherit`` filter for a private server: the caller's API keys stay out (it would not know them)."""
    return name.upper() not in API_KEY_VARIABLES


class ServerStartError(RuntimeError):
    """The server exited (or never answered) before it was ready; the message ends with its log's tail."""

    def __init__(self, message: str, log_tail: str, returncode: int | None = None):
        super().__init__(f"{message}\n{log_tail}" if log_tail else message)
        self.log_tail = log_tail
        self.returncode = returncode


class ServerNotReady(ServerStartError, TimeoutError):
    """The server still ran but did not answer 200 within the time given."""


class ServerProcess:
    """A server program (``command``, with the whole environment ``env``) started at once on ``host:port``, in its
    own process group; stdout and stderr go to ``log_dir/{name}-{port}.log``. A context manager: leaving stops it.

    ``wait_ready()`` polls ``ready_path`` until it answers 200 and raises ``ServerStartError`` (the exit status
    and the log's tail) when the server exits first, ``ServerNotReady`` when time runs out."""

    def __init__(
        self,
        command: Sequence[str],
        env: Mapping[str, str],
        *,
        port: int,
        log_dir: Path = ROOT / ".cache",
        name: str = "server",
        ready_path: str = "/health",
        cwd: Path | None = None,
        host: str = "127.0.0.1",
    ):
        self.host, self.port = host, port
        self.address = f"{host}:{self.port}"
        self.url = f"http://{self.address}"
        self.name = name
        self.ready_path = ready_path
        self.command = list(command)
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}-{self.port}.log"
        self.log = open(self.log_path, "w+")  # open while the server runs; stop() closes it
        try:
            self.proc = subprocess.Popen(
                self.command,
                cwd=cwd,
                env=dict(env),
                stdout=self.log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        except BaseException:
            self.log.close()
            raise

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def answers(self, path: str | None = None, timeout: float = 5) -> int | None:
        """The status of ``GET path`` (default: ``ready_path``), None when the server does not answer."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request("GET", path or self.ready_path, headers={"Connection": "close"})
            response = conn.getresponse()
            response.read()
            return response.status
        except (OSError, http.client.HTTPException):
            return None
        finally:
            conn.close()

    def wait_ready(self, timeout: float = 300, path: str | None = None) -> float:
        """Poll until ``path`` (default: ``ready_path``) answers 200; the seconds it took."""
        start = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"{self.name} on {self.address} exited {self.proc.returncode} before it was ready; its log:",
                    self.tail(),
                    self.proc.returncode,
                )
            if self.answers(path) == 200:
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise ServerNotReady(
                    f"{self.name} on {self.address} not ready after {timeout:.0f} s; its log:", self.tail()
                )
            time.sleep(0.2)

    def output(self) -> str:
        """All the server has written so far."""
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def tail(self, chars: int = 3000) -> str:
        return self.output()[-chars:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30, *, group: bool = True) -> int | None:
        """``stop_process`` (to the group, or with ``group=False`` to the leader alone), then the log is closed;
        the exit status."""
        stop_process(self.proc, sig, timeout, group=group)
        if not self.log.closed:
            self.log.close()
        return self.proc.returncode


class GunicornServer(ServerProcess):
    """``gunicorn -c gunicorn.conf.py -b 127.0.0.1:PORT [args] wsgi:app`` (a ``ServerProcess``), with ``env`` over
    the caller's environment (names that ``inherit`` rejects left out) and over ``OFFLINE_ENV``."""

    def __init__(
        self,
        env: Mapping[str, str],
        *,
        log_dir: Path = ROOT / ".cache",
        name: str = "gunicorn",
        args: Sequence[str] = (),
        app: str = "wsgi:app",
        ready_path: str = "/health",
        inherit: Callable[[str], bool] | None = None,
        cwd: Path = ROOT,
        host: str = "127.0.0.1",
        port: int | None = None,
    ):
        port = port or free_port(host)
        self.env = {**OFFLINE_ENV, **env}
        inherited = {k: v for k, v in os.environ.items() if inherit is None or inherit(k)}
        script = Path(sys.executable).parent / "gunicorn"
        # the console script beside this interpreter; where gunicorn was installed elsewhere (pip --target), its
        # module through this interpreter
        gunicorn = [str(script)] if script.exists() else [sys.executable, "-m", "gunicorn"]
        super().__init__(
            [*gunicorn, "-c", "gunicorn.conf.py", "-b", f"{host}:{port}", *args, app],
            {**inherited, **self.env},
            port=port,
            log_dir=log_dir,
            name=name,
            ready_path=ready_path,
            cwd=cwd,
            host=host,
        )

    def worker_pids(self) -> list[int]:
        """The master's children (the workers) and theirs (an engine process), recursively."""
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            try:
                children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
            except OSError:
                children = []
            out.extend(children)
            todo.extend(children)
        return out


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


def nginx_binary() -> str | None:
    """The nginx executable (Debian puts it in /usr/sbin, which is not on every user's PATH)."""
    import shutil

    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


class NginxServer:
    """nginx in the foreground as the current user, every path (pid, logs, temp files) under ``root``, listening on
    a free loopback port (``port``); a subclass writes its site into ``root / "saker.conf"`` (the main
    ``nginx.conf`` includes it), then calls ``start()``."""

    def __init__(self, root: Path, *, workers: int = 1, connections: int = 256, access_log: str = ""):
        self.binary = nginx_binary()
        if not self.binary:
            raise RuntimeError("nginx is not installed (apt-get install nginx)")
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        root.mkdir(parents=True, exist_ok=True)
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
worker_processes {workers};
pid {root / "nginx.pid"};
error_log {root / "error.log"} info;
{user}
events {{ worker_connections {connections}; }}
http {{
{access_log or f"    access_log {root / 'access.log'};"}
{temp}
    include {root / "saker.conf"};
}}
""")

    def _args(self) -> list[str]:
        return ["-p", str(self.root), "-c", str(self.root / "nginx.conf"), "-e", str(self.root / "error.log")]

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, *self._args()], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )

    def check_config(self) -> subprocess.CompletedProcess:
        return subprocess.run([self.binary, "-t", *self._args()], capture_output=True, text=True)

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
        return log.read_text(errors="replace") if log.exists() else ""

    def stop(self) -> None:
        if self.proc is None:
            return
        stop_process(self.proc, signal.SIGQUIT, 15)
        if self.proc.stdout:
            self.proc.stdout.close()  # never read (nginx logs to files); left open it is a ResourceWarning
