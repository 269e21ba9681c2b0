"""``python -m app serve [--model ... --host ... --port ...]``: the development server (Flask's).
``python -m app batch [settings flags] INPUT [INPUT ...] [-o OUTPUT | --output-dir DIR]``: JSONL files offline
(see ``app/batch/`` and docs/batch.md).
``python -m app bench [...]``: the performance suite (docs/performance.md).
``python -m app reliability [--quick] [--model DIR] [--out FILE]``: the reliability figures (docs/deployment.md,
Reliability).
``python -m app chat [--url ...]``: the terminal chat client.

chat, bench and reliability are the tooling (``tooling/``, not the server): thin forwards that import it only when
one of them runs, so the server (and the Docker image, which holds app/ alone) never loads it."""

from __future__ import annotations

import argparse
import sys

from app.errors import ConfigError
from app.settings import add_settings_arguments, settings_from_args


# the tooling's commands: (help, description); each runs through its forward below
TOOLING = {
    "chat": ("an interactive chat shell for a running server (this one or any OpenAI-compatible one)", None),
    "bench": (
        "the performance suite: table, JSON and plot in docs/performance/ (docs/performance.md)",
        "Benchmark our server (started here) or any OpenAI-compatible one (--url).",
    ),
    "reliability": (
        "the reliability figures: load with drops, bad inputs, slow clients, memory, client close (docs/deployment.md)",
        "Start a gunicorn on 127.0.0.1 and measure how it holds up.",
    ),
}


def _tooling_parser(command: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"python -m app {command}", description=TOOLING[command][1])


def chat(argv: list[str]) -> int:
    from tooling import chat_client

    parser = _tooling_parser("chat")
    chat_client.add_arguments(parser)
    return chat_client.main(parser.parse_args(argv))


def bench(argv: list[str]) -> int:
    from tooling.bench import cli

    parser = _tooling_parser("bench")
    cli.add_arguments(parser)
    return cli.main(parser.parse_args(argv))


def reliability(argv: list[str]) -> int:
    from tooling import reliability as command

    parser = _tooling_parser("reliability")
    command.add_arguments(parser)
    return command.main(parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    forwards = {"chat": chat, "bench": bench, "reliability": reliability}
    if argv and argv[0] in forwards:
        try:
            return forwards[argv[0]](argv[1:])
        except ModuleNotFoundError as exc:
            if exc.name != "tooling":
                raise
            print(
                f"saker: {argv[0]} is part of the tooling (tooling/), which is not here (the server alone is)",
                file=sys.stderr,
            )
            return 2
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
    for command, (help_text, _) in TOOLING.items():  # listed in --help; they run above, before this parser
        sub.add_parser(command, help=help_text, add_help=False)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's own usage, not the top-level one
        commands = {"serve": serve, "batch": batch}
        commands.get(args.command, parser).error(f"unrecognized arguments: {' '.join(unknown)}")
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
