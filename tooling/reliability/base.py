"""A reliability run's state and set-up, shared by the sections: the plan from the command line, the server
started and measured (context, tokens per word, RSS at ready), goals, waiting until the server is idle."""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tooling.reliability.plan import PLAIN_TEMPLATE, SECTIONS, Plan
from tooling.reliability.server import Server
from tooling.reliability.wire import metrics, post_json, sample


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


class RunBase:
    """What every section reads: ``args``, ``plan``, ``server``/``port``, the model's ``config``, ``name``,
    ``context`` and ``vocab``; what they write: ``report`` and ``goals``."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.plan = Plan.quick() if args.quick else Plan()
        if args.clients:
            self.plan.levels = tuple(int(x) for x in args.clients.split(",") if x.strip())
        for name in ("load_seconds", "slow_clients", "slow_seconds"):
            if getattr(args, name) is not None:
                setattr(self.plan, name, getattr(args, name))
        if args.close_cases:
            self.plan.close_cases = tuple(x.strip() for x in args.close_cases.split(",") if x.strip())
        self.sections = [s.strip() for s in (args.only or ",".join(SECTIONS)).split(",") if s.strip()]
        unknown = set(self.sections) - set(SECTIONS)
        if unknown:
            raise SystemExit(f"saker reliability: unknown sections {sorted(unknown)}; choose from {SECTIONS}")
        self.server: Server | None = None
        self.model_dir: Path | None = None
        self.config: dict = {}
        self.name = "model"
        self.context = 0
        self.vocab = 0
        self.chat_template_given = False
        self.server_env: dict[str, str] = {}
        self.report: dict[str, Any] = {}
        self.goals: list[dict] = []

    def log(self, message: str) -> None:
        print(f"[reliability {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    def goal(self, section: str, what: str, met: bool | None, figure: str, correctness: bool) -> None:
        """A goal line: ``correctness`` goals decide the exit status; the others (timing, memory) are reported."""
        self.goals.append({"section": section, "goal": what, "met": met, "figure": figure, "correctness": correctness})

    def model(self) -> Path:
        if self.args.model:
            return Path(self.args.model).expanduser().resolve()
        from app.engine.model.load_config import LoadConfig
        from app.engine.model.loader import ensure_default_model

        self.log("converting/checking the embedded SmolLM2 (once)")
        return ensure_default_model(LoadConfig(cache_dir=str(Path(self.args.cache_dir).expanduser().resolve())))

    def start(self) -> None:
        self.model_dir = self.model()
        self.config = json.loads((self.model_dir / "config.json").read_text())
        self.name = self.args.served_name or self.model_dir.name
        env = {}
        for item in self.args.server_env or []:
            key, sep, value = item.partition("=")
            if not sep:
                raise SystemExit(f"saker reliability: --server-env {item!r} is not KEY=VALUE")
            env[key] = value
        if not self._has_chat_template() and "SAKER_CHAT_TEMPLATE" not in env:
            env["SAKER_CHAT_TEMPLATE"] = PLAIN_TEMPLATE  # so chat requests can be part of the mix
            self.chat_template_given = True
        self.server_env = env
        log_dir = Path(self.args.out).expanduser().resolve().parent
        self.server = Server(self.model_dir, self.name, env, log_dir)
        self.log(f"starting gunicorn on {self.server.url} with {self.model_dir} (log {self.server.log_path})")
        ready_s = self.server.wait_ready()
        _, info = post_json(self.port, "/tokenize", {"prompt": "hello " * 100})
        _, more = post_json(self.port, "/tokenize", {"prompt": "hello " * 200})
        self.context = int(info.get("max_model_len") or 0)
        per_word = (int(more.get("count") or 200) - int(info.get("count") or 100)) / 100
        self.hello_tokens_per_word = per_word if per_word > 0 else 1.0
        self.hello_tokens_extra = max(0.0, int(info.get("count") or 100) - 100 * self.hello_tokens_per_word)
        self.vocab = int(self.config.get("vocab_size") or 0)
        self.report["server"] = {
            "model": str(self.model_dir),
            "served_name": self.name,
            "context": self.context,
            "ready_s": round(ready_s, 1),
            "workers": self.server.worker_pids(),
            "env": {k: v for k, v in env.items() if k != "SAKER_CHAT_TEMPLATE"},
            "chat_template": "a plain one given by this script" if self.chat_template_given else "the model's own",
            "log": str(self.server.log_path),
        }
        self.rss_at_ready = self.server.rss_bytes()
        self.log(
            f"ready in {ready_s:.1f} s; context {self.context} tokens, worker RSS {self.rss_at_ready / 2**20:.0f} MiB"
        )

    def _has_chat_template(self) -> bool:
        assert self.model_dir is not None
        if (self.model_dir / "chat_template.jinja").exists() or (self.model_dir / "chat_template.json").exists():
            return True
        with contextlib.suppress(OSError, ValueError):
            return bool(json.loads((self.model_dir / "tokenizer_config.json").read_text()).get("chat_template"))
        return False

    def hello_words(self, tokens: int) -> int:
        """How many "hello " make a prompt of about ``tokens`` tokens (8100 -> 8099 on SmolLM2)."""
        return max(1, int((tokens - self.hello_tokens_extra) / self.hello_tokens_per_word))

    def random_ids(self, n: int, rng: random.Random) -> list[int]:
        hi = max(10, min(self.vocab, 30000) - 5)
        return [rng.randrange(5, hi) for _ in range(n)]

    def settle(self, timeout: float = 60.0) -> tuple[bool, float, dict]:
        """Wait until the run's server works on nothing (``wait_settled``)."""
        return wait_settled(self.port, timeout)

    def server_health(self) -> dict:
        out = self.server.output() if self.server else ""
        health = {
            "tracebacks_in_log": out.count("Traceback"),
            "workers_booted": out.count("Booting worker"),
            "worker_exits": len(re.findall(r"Worker \(pid:\d+\) (?:exited|was sent)", out)),
        }
        self.goal(
            "server",
            "no traceback and no worker restart in the server log",
            health["tracebacks_in_log"] == 0 and health["workers_booted"] == 1,
            f"{health['tracebacks_in_log']} tracebacks, {health['workers_booted']} worker boots",
            True,
        )
        return health


def wait_settled(port: int, timeout: float = 60.0) -> tuple[bool, float, dict]:
    """Until the server at ``port`` works on nothing (running, queued and in flight besides this scrape all 0)."""
    start = time.monotonic()
    values: dict = {}
    tick = threading.Event()
    while time.monotonic() - start < timeout:
        with contextlib.suppress(Exception):
            values = metrics(port)
            if (
                sample(values, "saker_requests_running") == 0
                and sample(values, "saker_queue_depth") == 0
                and sample(values, "saker_requests_in_flight") <= 1
            ):
                return True, time.monotonic() - start, values
        tick.wait(0.1)
    return False, time.monotonic() - start, values
