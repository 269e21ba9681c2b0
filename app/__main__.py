"""``python -m app serve [--model ... --host ... --port ...]``: the development server (Flask's).
``python -m app batch [settings flags] INPUT [INPUT ...] [-o OUTPUT | --output-dir DIR]``: JSONL files offline
(see ``app/batch/`` and docs/batch.md).
``python -m app bench [...]``: the performance suite (docs/performance.md).
``python -m app reliability [--quick] [--model DIR] [--out FILE]``: the reliability figures (docs/deployment.md,
Reliability)."""

from __future__ import annotations

import argparse
import sys

from app.errors import ConfigError
from app.settings import add_settings_arguments, settings_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app", description="saker: OpenAI-compatible completions")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve the model with Flask's development server (production: gunicorn -c gunicorn.conf.py wsgi:app)",
    )
    add_settings_arguments(serve)
    from app import batch as batch_command

    batch = sub.add_parser(
        "batch",
        help="answer JSONL files of requests offline (docs/batch.md)",
        description="Answer JSONL files of completion requests offline.",
    )
    batch_command.add_arguments(batch)
    from app import chat_client

    chat = sub.add_parser(
        "chat", help="an interactive chat shell for a running server (this one or any OpenAI-compatible one)"
    )
    chat_client.add_arguments(chat)
    from app.bench import cli as bench_command

    bench = sub.add_parser(
        "bench",
        help="the performance suite: table, JSON and plot in docs/performance/ (docs/performance.md)",
        description="Benchmark our server (started here) or any OpenAI-compatible one (--url).",
    )
    bench_command.add_arguments(bench)
    from app import reliability as reliability_command

    reliability = sub.add_parser(
        "reliability",
        help="the reliability figures: load with drops, bad inputs, slow "
        "clients, memory, client close (docs/deployment.md)",
        description="Start a gunicorn on 127.0.0.1 and measure how it holds up.",
    )
    reliability_command.add_arguments(reliability)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's own usage, not the top-level one
        commands = {"serve": serve, "batch": batch, "chat": chat, "bench": bench}
        commands.get(args.command, parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "chat":
        return chat_client.main(args)
    if args.command == "bench":
        return bench_command.main(args)
    if args.command == "reliability":
        return reliability_command.main(args)
    try:
        settings = settings_from_args(args)
    except ConfigError as exc:
        print(f"saker: {exc}", file=sys.stderr)
        return 2
    from app.log_config import adopt_library_loggers, configure_logging

    configure_logging(settings)  # the same logging configuration as gunicorn's (SAKER_LOG_FORMAT, app/log_config.py)
    if args.command == "batch":
        return batch_command.run(args, settings, hard_exit=True)
    if args.command == "serve":
        from app import create_app

        app = create_app(settings, exit_on_load_error=True)
        adopt_library_loggers()
        app.run(host=settings.host, port=settings.port, threaded=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
