"""The files of a run: each input with the output it is answered into (``BatchFile``), planned from the command
line (``plan_files``) and checked against what an earlier run wrote (``check_file``), so that a rerun resumes."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from app.batch.inputs import UsageError, expand_inputs, fingerprint, read_lines, request_identity
from app.batch.outputs import scan_output


def output_name(path: Path) -> str:
    """``request_3.jsonl`` -> ``output_request_3.jsonl`` (Together's naming)."""
    return f"output_{path.stem}.jsonl"


@dataclass
class BatchFile:
    """One input file and the output it is answered into, with what the output already holds."""

    input: Path
    output: Path
    lines: int = 0  # non-blank input lines
    done: dict[int, bool] = field(default_factory=dict)  # line -> answered with a result (False: error)
    pending: int = 0
    dirty: bool = False  # its output needs cleaning (see scan_output)


def plan_files(patterns: list[str], output: str | None, output_dir: str | None) -> list[BatchFile]:
    inputs = expand_inputs(patterns)
    if output is not None and len(inputs) != 1:
        raise UsageError(f"-o/--output takes one input, got {len(inputs)}; use --output-dir for several")
    if output is not None:
        outputs = [Path(output)]
    elif output_dir is not None:
        outputs = [Path(output_dir) / output_name(p) for p in inputs]
    else:
        outputs = [p.parent / output_name(p) for p in inputs]
    # A glob such as data/*.jsonl also matches the outputs of an earlier run: those are not inputs.
    output_set = {o.resolve() for o in outputs}
    batch_files = []
    for path, out in zip(inputs, outputs):
        if path.resolve() in output_set and path.resolve() != out.resolve():
            print(f"saker batch: skipping {path}: it is the output of another input", file=sys.stderr)
            continue
        batch_files.append(BatchFile(path, out))
    seen: dict[Path, Path] = {}
    for batch_file in batch_files:
        if batch_file.output.resolve() == batch_file.input.resolve():
            raise UsageError(f"the output {batch_file.output} is the input itself")
        other = seen.setdefault(batch_file.output.resolve(), batch_file.input)
        if other is not batch_file.input:
            raise UsageError(f"inputs {other} and {batch_file.input} would both write {batch_file.output}")
    if not batch_files:
        raise UsageError("no input files left to answer")
    return batch_files


def check_file(batch_file: BatchFile) -> None:
    """Count the input's lines, and check that the lines already answered are the ones in the input."""
    state = scan_output(batch_file.output)
    batch_file.done, batch_file.dirty = state.done, state.dirty
    batch_file.lines = batch_file.pending = 0
    numbers = set()
    for number, text, raw in read_lines(batch_file.input):
        batch_file.lines += 1
        numbers.add(number)
        if number not in state.prints:
            batch_file.pending += 1
        elif state.prints[number] != fingerprint(request_identity(text, raw)):
            raise UsageError(
                f"{batch_file.output} line for input line {number} holds another request than "
                f"{batch_file.input}: the input changed since that output was written; move the output "
                f"away (or use --output-dir) to start afresh"
            )
    extra = sorted(set(state.prints) - numbers)
    if extra:
        raise UsageError(
            f"{batch_file.output} answers line {extra[0]}, which {batch_file.input} does not have: "
            f"the input changed since that output was written"
        )
