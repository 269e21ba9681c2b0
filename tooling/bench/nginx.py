"""nginx in front of saker replicas, as ``deploy/nginx/saker-replicas.conf`` ships it: ``render_replicas_conf``
points the config's upstreams at given replica addresses, ``Router`` runs nginx in the foreground as the current
user with every path under one folder. The replica bench (``tooling/bench/replicas.py``) and
tests/live/test_replicas.py run the shipped config with them."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Sequence

from tooling.processes import ROOT, NginxServer, nginx_binary  # noqa: F401 - nginx_binary re-exported for the replica bench

REPLICAS_CONF = ROOT / "deploy" / "nginx" / "saker-replicas.conf"

# every request nginx answers, one JSON line: which replica(s) it went to (a retried request lists several)
ROUTER_LOG_FORMAT = (
    'escape=json \'{"msec":$msec,"request_time":$request_time,"request_id":"$saker_request_id",'
    '"session":"$http_x_session_id","uri":"$uri","status":$status,'
    '"upstream":"$upstream_addr","upstream_status":"$upstream_status"}\''
)

_UPSTREAM = re.compile(r"^(upstream\s+[\w.-]+\s*\{)(.*?)(^\})", re.S | re.M)
_SERVER_LINE = re.compile(r"^([ \t]*)server[ \t]+(\S+?)((?:[ \t]+[^;\n]*)?);[^\n]*\n", re.M)


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


class Router(NginxServer):
    """nginx (``tooling.processes.NginxServer``) serving ``site`` (deploy/nginx/saker-replicas.conf) with its upstreams
    pointed at ``replicas``. Its access log (``access()``) says which replica each request went to."""

    def __init__(self, root: Path, replicas: Sequence[str], site: Path = REPLICAS_CONF, workers: int = 1):
        super().__init__(
            root,
            workers=workers,
            connections=1024,
            access_log=(
                f"    log_format saker_router {ROUTER_LOG_FORMAT};\n    access_log {root / 'access.log'} saker_router;"
            ),
        )
        self.site = site
        self.configure(replicas)
        self.start()

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
