"""nginx in front of saker replicas, as ``deploy/nginx/saker-replicas.conf`` ships it: ``render_replicas_conf``
points the config's upstreams at given replica addresses, ``Router`` runs nginx in the foreground as the current
user with every path under one folder. The replica bench (``app/bench/replicas.py``) and tests/live/test_replicas.py run
the shipped config with them."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Sequence

from app.processes import ROOT, free_port, stop_process

REPLICAS_CONF = ROOT / "deploy" / "nginx" / "saker-replicas.conf"

# every request nginx answers, one JSON line: which replica(s) it went to (a retried request lists several)
ROUTER_LOG_FORMAT = (
    'escape=json \'{"msec":$msec,"request_time":$request_time,"request_id":"$saker_request_id",'
    '"session":"$http_x_session_id","uri":"$uri","status":$status,'
    '"upstream":"$upstream_addr","upstream_status":"$upstream_status"}\''
)

_UPSTREAM = re.compile(r"^(upstream\s+[\w.-]+\s*\{)(.*?)(^\})", re.S | re.M)
_SERVER_LINE = re.compile(r"^([ \t]*)server[ \t]+(\S+?)((?:[ \t]+[^;\n]*)?);[^\n]*\n", re.M)


def nginx_binary() -> str | None:
    """The nginx executable (Debian puts it in /usr/sbin, which is not on every user's PATH)."""
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


def render_replicas_conf(text: str, replicas: Sequence[str], listen: str) -> str:
    """``deploy/nginx/saker-replicas.conf`` with the ``server`` lines of every upstream block replaced by one per
    replica address (keeping the parameters of the block's first line) and ``listen 80;`` by ``listen``."""
    if not replicas:
        raise ValueError("at least one replica")
    blocks = 0

    def upstream(match: re.Match) -> str:
        nonlocal blocks
        blocks += 1
        head, body, tail = match.groups()
        lines = list(_SERVER_LINE.finditer(body))
        if not lines:
            raise ValueError(f"no server line in {head!r}")
        indent, params = lines[0].group(1), lines[0].group(3)
        new = "".join(f"{indent}server {addr}{params};\n" for addr in replicas)
        out, at = [], 0
        for i, line in enumerate(lines):
            out.append(body[at : line.start()])
            if i == 0:
                out.append(new)
            at = line.end()
        out.append(body[at:])
        return head + "".join(out) + tail

    text = _UPSTREAM.sub(upstream, text)
    text, listens = re.subn(r"^(\s*)listen 80;", rf"\g<1>listen {listen};", text, flags=re.M)
    if blocks < 1 or listens != 1:
        raise ValueError(f"unexpected config shape: {blocks} upstream blocks, {listens} `listen 80;` lines")
    return text


class Router:
    """nginx in the foreground as the current user, every path (pid, logs, temp files) under ``root``, serving
    ``site`` (deploy/nginx/saker-replicas.conf) with its upstreams pointed at ``replicas`` and its listener on a
    free loopback port. Its access log (``access()``) says which replica each request went to."""

    def __init__(self, root: Path, replicas: Sequence[str], site: Path = REPLICAS_CONF, workers: int = 1):
        self.binary = nginx_binary()
        if not self.binary:
            raise RuntimeError("nginx is not installed (apt-get install nginx)")
        self.root, self.site = root, site
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        root.mkdir(parents=True, exist_ok=True)
        self.configure(replicas)
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
events {{ worker_connections 1024; }}
http {{
    log_format saker_router {ROUTER_LOG_FORMAT};
    access_log {root / "access.log"} saker_router;
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

    def configure(self, replicas: Sequence[str]) -> None:
        self.replicas = list(replicas)
        (self.root / "saker.conf").write_text(
            render_replicas_conf(self.site.read_text(), self.replicas, f"127.0.0.1:{self.port}")
        )

    def reload(self, replicas: Sequence[str], timeout: float = 15) -> None:
        """Point the upstreams at ``replicas`` and reload (SIGHUP, as ``nginx -s reload``); returns once the new
        workers run and the old ones no longer accept connections."""
        self.configure(replicas)
        log = self.output()
        started, stopping = log.count("start worker process"), log.count("gracefully shutting down")
        os.kill(self.proc.pid, signal.SIGHUP)
        deadline = time.time() + timeout
        # the new workers run and the old ones have stopped accepting (they finish what they hold)
        while (log := self.output()).count("start worker process") <= started or log.count(
            "gracefully shutting down"
        ) <= stopping:
            if time.time() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"nginx did not reload: {self.output()[-2000:]}")
            time.sleep(0.05)

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
        return log.read_text(errors="replace") if log.exists() else ""

    def access(self, wait_for: Sequence[str] = (), timeout: float = 10) -> list[dict]:
        """nginx's access log, one dict per request; waits until the request ids ``wait_for`` are in it (nginx
        writes a line once the answer is sent, so just after the client has it)."""
        log = self.root / "access.log"
        deadline = time.time() + timeout
        while True:
            lines = [
                json.loads(line)
                for line in (log.read_text().splitlines() if log.exists() else [])
                if line.endswith("}")
            ]
            if not wait_for or time.time() > deadline or set(wait_for) <= {x["request_id"] for x in lines}:
                return lines
            time.sleep(0.05)

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGQUIT, 15)
        if self.proc.stdout:
            self.proc.stdout.close()
