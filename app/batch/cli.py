"""``python -m app batch``: the arguments, loading the model, the run, the summary line and the exit code."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from datetime import datetime, timezone

from app.batch.files import check_file, plan_files
from app.batch.inputs import UsageError
from app.batch.runner import Stats, run_files
from app.batch.signals import Interrupted, SignalGuard
from app.errors import ConfigError

log = logging.getLogger("saker.batch")

DEFAULT_MAX_BATCH_TOKENS = 8192
EXIT_OK, EXIT_ERRORS, EXIT_USAGE = 0, 1, 2


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _positive_int(text: str) -> int:
    value = _int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The settings flags (as for ``serve``) plus the batch flags."""
    from app.settings import add_settings_arguments

    add_settings_arguments(parser)
    group = parser.add_argument_group("batch")
    group.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="JSONL request files; globs are expanded (quote them to let saker expand them)",
    )
    where = group.add_mutually_exclusive_group()
    where.add_argument(
        "-o",
        "--output",
        metavar="OUTPUT",
        help="output file (one INPUT only). Default: output_<name>.jsonl beside each input",
    )
    where.add_argument("--output-dir", metavar="DIR", help="write output_<name>.jsonl files into DIR")
    group.add_argument(
        "--max-batch-tokens",
        type=_positive_int,
        default=DEFAULT_MAX_BATCH_TOKENS,
        metavar="N",
        help="the token budget of one batch of lines (prompt + max_tokens per request; a line over it goes alone): "
        f"the lines the engine is given at once, and the batch_time they share. Default: {DEFAULT_MAX_BATCH_TOKENS}",
    )
    group.add_argument(
        "--seed",
        type=_int,
        default=None,
        help="requests without their own seed get one derived from this, the input file name and "
        "the line number (sampled results then survive resumes and re-runs)",
    )
    group.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m app batch", description="Answer JSONL files of completion requests offline."
    )
    add_arguments(parser)
    return parser


def _load_service(settings, worker=None):
    from app.engine.core.worker import Worker
    from app.service import CompletionService

    if worker is None:
        worker = Worker.from_settings(settings)
        worker.load()
    return CompletionService(settings, worker)


def run(args: argparse.Namespace, settings=None, *, service=None, worker=None, hard_exit: bool = False) -> int:
    """The batch command on parsed arguments. ``service``/``worker``: injected by tests (no model load)."""
    from app.settings import settings_from_args

    run_id = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    try:
        if settings is None:
            settings = settings_from_args(args)
        logging.basicConfig(
            level=settings.log_level.upper(),
            stream=sys.stderr,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        batch_files = plan_files(args.inputs, args.output, args.output_dir)
        for batch_file in batch_files:
            check_file(batch_file)
        for batch_file in batch_files:
            if batch_file.pending:
                target = batch_file.output.parent
                while not target.exists() and target != target.parent:
                    target = target.parent
                if not os.access(target, os.W_OK):
                    raise UsageError(f"cannot write {batch_file.output}: {target} is not writable")
    except (UsageError, ConfigError) as exc:
        print(f"saker batch: {exc}", file=sys.stderr)
        return EXIT_USAGE

    stats = Stats(run_id, args.seed, batch_files)
    requests = stats.counts()[0]
    pending = sum(f.pending for f in batch_files)
    log.info(
        "%d input file(s), %d request line(s), %d already answered, %d to run",
        len(batch_files),
        requests,
        requests - pending,
        pending,
    )

    guard = SignalGuard()
    guard.install()
    status, code = "SUCCESS", EXIT_OK
    try:
        if pending and service is None:
            try:
                service = _load_service(settings, worker)
            except ConfigError as exc:
                print(f"saker batch: {exc}", file=sys.stderr)
                return EXIT_USAGE
        if pending or any(batch_file.dirty for batch_file in batch_files):
            stats.started = time.perf_counter()
            skipped = run_files(
                service,
                batch_files,
                max_batch_tokens=args.max_batch_tokens,
                seed=args.seed,
                progress=not args.no_progress,
                stats=stats,
                guard=guard,
            )
            if skipped:
                status, code = "INCOMPLETE", EXIT_ERRORS
        if status == "SUCCESS" and stats.counts()[2]:
            status, code = "COMPLETED_WITH_ERRORS", EXIT_ERRORS
    except Interrupted as exc:
        guard.restore()
        name = signal.Signals(exc.signum).name
        print(
            f"saker batch: interrupted by {name}; the output holds whole lines only, rerun the same command to resume",
            file=sys.stderr,
        )
        status, code = "INTERRUPTED", 128 + exc.signum
    except Exception:
        log.exception("saker batch: the run failed")
        status, code = "FAILED", EXIT_ERRORS
    finally:
        guard.restore()
    print(json.dumps(stats.summary(status)), flush=True)
    if hard_exit and status == "INTERRUPTED":
        # The output is whole and the summary out; the requests still in flight run on threads inside torch, and
        # an interpreter shutdown under them aborts the process ("terminate called without an active
        # exception", exit 134). Leave at once with the documented code instead (the command line only).
        sys.stderr.flush()
        os._exit(code)
    return code


def main(argv: list[str] | None = None, *, service=None, worker=None) -> int:
    """``python -m app batch ...`` without the ``batch`` word; returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: usage errors exit 2, --help exits 0
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    return run(args, service=service, worker=worker)
