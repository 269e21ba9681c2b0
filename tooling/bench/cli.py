"""``python -m app bench`` / ``saker bench``: the flags and ``main`` (run, write bench.json and bench.png, print the
table and how long the run took)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import textwrap
from pathlib import Path

from tooling.bench import parts
from tooling.bench.plan import DEFAULT_CACHE, DEFAULT_OUT


def parse_parts(args: argparse.Namespace) -> tuple[str, ...]:
    """The parts to run, in the suite's order: ``--only``'s, or the default ones (and the GPU ones with --gpu)."""
    if args.only:
        chosen = [p.strip().upper() for p in args.only.split(",") if p.strip()]
        unknown = [p for p in chosen if p not in parts.ALL_PARTS]
        if unknown:
            raise SystemExit(
                f"saker bench: unknown part(s) {', '.join(unknown)}; choose from {', '.join(parts.ALL_PARTS)}"
            )
        return tuple(p for p in parts.ALL_PARTS if p in chosen)
    return parts.DEFAULT_PARTS + (parts.GPU_PARTS if args.gpu else ())


def parts_epilog(width: int | None = None) -> str:
    """The parts for --help, wrapped to the terminal (from ``parts.PARTS``, as the package docstring)."""
    if width is None:
        width = min(100, max(60, shutil.get_terminal_size().columns - 2))
    out = []
    for line in parts.overview().split("\n"):
        indent = " " * (len(line) - len(line.lstrip()) + (3 if line.startswith("  ") else 0))
        wrapped = textwrap.fill(line, width, subsequent_indent=indent, break_on_hyphens=False, break_long_words=False)
        out.append(wrapped if line else "")
    return "\n".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = parts_epilog()
    parser.add_argument(
        "--only",
        metavar="PARTS",
        help=f"comma-separated parts to run, of {','.join(parts.ALL_PARTS)} (default {','.join(parts.DEFAULT_PARTS)}; "
        f"{','.join(parts.GPU_PARTS)} with --gpu): see below",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: every part once with short generations and the fewest repetitions, none replaced "
        "when other processes disturb them; its time is mostly server starts and model loads (and building "
        "the models on a first run), so it depends on the machine: the run prints how long it took. "
        "Numbers are not comparable with a full run",
    )
    parser.add_argument(
        "--size",
        choices=("small", "tiny"),
        default="small",
        help="model for A/B/T/L/R: small = GPT-2-small shape (the suite's definition), tiny = the "
        "tests' 2-layer model (smoke runs)",
    )
    parser.add_argument(
        "--url",
        help="benchmark this running OpenAI-compatible server instead of starting ours "
        "(base URL, with or without /v1); only HTTP-side measurements run, R as that server serves",
    )
    parser.add_argument("--model", help="with --url: the model name to request (default: the first of /v1/models)")
    parser.add_argument("--api-key", help="with --url: sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--prompt", help="with --url: the prompt text (default: a ~64-token English paragraph)")
    parser.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (for servers that reject the vLLM extension; generations may then end early)",
    )
    parser.add_argument("--gpu", action="store_true", help=f"also run {','.join(parts.GPU_PARTS)} (needs a CUDA GPU)")
    parser.add_argument("--device", default="cuda", help="device for part D (default cuda); the others run on the CPU")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads in the bench process and the "
        "server (OMP_NUM_THREADS); default: torch's default on this machine",
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=None,
        help="passed to our server as SAKER_MAX_BATCH_ROWS and SAKER_MAX_RUNNING_REQUESTS",
    )
    parser.add_argument(
        "--server-env",
        action="append",
        metavar="KEY=VALUE",
        help="extra environment for our server, e.g. SAKER_COMPILE=1 (repeatable)",
    )
    parser.add_argument(
        "--speculative-modes",
        default="off,ngram,draft",
        metavar="MODES",
        help="P's servers, comma-separated SAKER_SPECULATIVE values (off and ngram always; default off,ngram,draft)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after A and C, record the server with py-spy "
        "for some more requests and summarize where its time goes (profile-A.txt, profile-C.txt)",
    )
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0,
        metavar="SECONDS",
        help="first wait up to this "
        "long for other processes to leave the CPU alone (a shared machine makes timings noisy)",
    )
    parser.add_argument(
        "--out-dir", default=str(DEFAULT_OUT), help="where bench.json and bench.png go (default docs/performance)"
    )
    parser.add_argument("--name", default=None, help="file name stem (default: bench, or external with --url)")
    parser.add_argument(
        "--cache-dir", default=str(DEFAULT_CACHE), help="where generated models are kept (default .cache/bench)"
    )


def main(args: argparse.Namespace) -> int:
    import torch

    from tooling.bench import report as reports
    from tooling.bench.runner import Bench

    selected = parse_parts(args)
    if args.threads is None:
        args.threads = torch.get_num_threads()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    bench = Bench(args, selected)
    try:
        report = bench.run()
    except KeyboardInterrupt:
        for server in list(bench.servers):
            bench.stop_server(server)
        print("saker bench: interrupted", file=sys.stderr)
        raise
    stem = args.name or ("external" if args.url else "bench")
    json_path, png_path = reports.write(report, Path(args.out_dir), stem)
    print(reports.format_table(report))
    print(f"\nwrote {json_path}" + (f" and {png_path}" if png_path else " (no plot: pip install matplotlib)"))
    print(reports.elapsed(report))
    return 1 if report["errors"] else 0
