"""``python -m app reliability``: the command line, and the run that goes through the sections in turn."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
from pathlib import Path

from tooling.reliability.bad import BadSection
from tooling.reliability.close import CloseSection
from tooling.reliability.load import LoadSection
from tooling.reliability.memory import MemorySection
from tooling.reliability.plan import DEFAULT_CACHE, DEFAULT_OUT, SECTIONS
from tooling.reliability.report import format_table
from tooling.reliability.slow import SlowSection
from tooling.reliability.wedge import WedgeSection


class Run(LoadSection, BadSection, SlowSection, MemorySection, CloseSection, WedgeSection):
    """The sections in the order asked, each a method ``section_<name>`` of its mixin."""

    def run(self) -> dict:
        started = time.time()
        self.report["started"] = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
        self.report["machine"] = {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average_at_start": list(os.getloadavg()),
        }
        self.report["plan"] = {**self.plan.__dict__, "quick": bool(self.args.quick), "sections": self.sections}
        try:
            self.start()
            for section in self.sections:
                self.log(f"section {section}")
                t0 = time.monotonic()
                try:
                    result = getattr(self, f"section_{section}")()
                except Exception as exc:
                    import traceback

                    result = {"error": repr(exc), "traceback": traceback.format_exc()}
                    self.goal(section, "the section ran", False, repr(exc)[:200], True)
                result["seconds"] = round(time.monotonic() - t0, 1)
                result["worker_rss_after"] = self.server.rss_bytes() if self.server else None
                self.report[section] = result
            self.report["server"].update(self.server_health())
        finally:
            if self.server is not None:
                self.server.stop()
        self.report["seconds"] = round(time.time() - started, 1)
        self.report["machine"]["load_average_at_end"] = list(os.getloadavg())
        self.report["goals"] = self.goals
        self.report["ok"] = all(g["met"] for g in self.goals if g["correctness"])
        return self.report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        help="model directory to serve (default: the embedded SmolLM2-135M-Instruct, converted once into --cache-dir)",
    )
    parser.add_argument("--served-name", help="the model's name in requests (default: the folder's name)")
    parser.add_argument(
        "--cache-dir", default=str(DEFAULT_CACHE), help="where the embedded model is converted (default .cache/saker)"
    )
    parser.add_argument(
        "--out",
        default=str(DEFAULT_OUT),
        help="the JSON report (default .cache/reliability/reliability.json; the server's logs go next to it)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the bounded form for CI: 16 and 64 clients for 5 s, "
        "fewer wrong values, 50 slow clients for 20 s, only the memory variant that fits, no "
        "close-during-prefill cases, wide requests with max_tokens 1-16 and faults for 5 s in process only",
    )
    parser.add_argument("--only", metavar="SECTIONS", help=f"comma-separated sections: {','.join(SECTIONS)}")
    parser.add_argument("--clients", metavar="N,N,...", help="load levels (default 16,32,64; quick 16,64)")
    parser.add_argument("--load-seconds", type=float, default=None, help="seconds per load level (60; quick 5)")
    parser.add_argument("--slow-clients", type=int, default=None, help="slow connections (200; quick 50)")
    parser.add_argument("--slow-seconds", type=float, default=None, help="seconds of slow clients (60; quick 20)")
    parser.add_argument(
        "--close-cases",
        metavar="A,B",
        help="client-close cases to run (default stream-decode,"
        "plain-decode,plain-stop-decode,stream-prefill,plain-prefill,stream-long-prefill; quick: the first two)",
    )
    parser.add_argument(
        "--memory-budget-tokens",
        type=int,
        default=4096,
        metavar="N",
        help="full mode: also run "
        "a long prompt, then a request of 2 x SAKER_MAX_BATCH_ROWS short rows, on a second server "
        "with SAKER_KV_CACHE_TOKENS=N (default 4096; 0: skip)",
    )
    parser.add_argument(
        "--server-env",
        action="append",
        metavar="KEY=VALUE",
        help="extra environment for the server, e.g. SAKER_MAX_QUEUE=4 (repeatable)",
    )


def main(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run = Run(args)
    try:
        report = run.run()
    except KeyboardInterrupt:
        print("saker reliability: interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"saker reliability: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    report["table"] = format_table(report)
    out.write_text(json.dumps(report, indent=1, ensure_ascii=False, default=str) + "\n")
    print(report["table"])
    print(f"\nreport: {out}")
    return 0 if report["ok"] else 1
