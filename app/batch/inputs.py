"""Reading the inputs: which files (names and globs), their non-blank lines, each line's JSON, and the identity of
a line that tells whether an output line answers it (``fingerprint``)."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Iterator

from app.errors import InvalidRequestError


class UsageError(Exception):
    """Bad arguments or inputs: one line on stderr, exit code 2, nothing run."""


def _natural_key(path: Path) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def expand_inputs(patterns: list[str]) -> list[Path]:
    """Files named or matched by glob patterns, in the order given (each glob's matches in natural order)."""
    paths: list[Path] = []
    seen: set[Path] = set()
    for pattern in patterns:
        if os.path.exists(pattern) or not glob.has_magic(pattern):
            if not os.path.isfile(pattern):
                raise UsageError(
                    f"input {pattern} does not exist"
                    if not os.path.exists(pattern)
                    else f"input {pattern} is not a file"
                )
            matches = [Path(pattern)]
        else:
            matches = sorted(
                (Path(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)), key=_natural_key
            )
            if not matches:
                raise UsageError(f"no input file matches {pattern}")
        for path in matches:
            if path.resolve() not in seen:
                seen.add(path.resolve())
                paths.append(path)
    return paths


def read_lines(path: Path) -> Iterator[tuple[int, str | None, bytes]]:
    """(1-based line number, text or None when not UTF-8, raw bytes) for each non-blank line."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            raw = raw.rstrip(b"\r\n")
            if not raw.strip():
                continue
            try:
                yield number, raw.decode("utf-8"), raw
            except UnicodeDecodeError:
                yield number, None, raw


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a valid JSON number")


def parse_json_line(text: str | None) -> Any:
    """The JSON value of a line; InvalidRequestError for anything that is not JSON."""
    if text is None:
        raise InvalidRequestError("the line is not valid UTF-8")
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise InvalidRequestError(f"the line is not valid JSON: {exc}") from None


def fingerprint(value: Any) -> str:
    """Identity of a request (or of a malformed line's text) to check that an output belongs to its input."""
    data = json.dumps(value, sort_keys=True, ensure_ascii=True, separators=(",", ":"), default=str)
    return hashlib.sha1(data.encode()).hexdigest()


def request_identity(text: str | None, raw: bytes) -> Any:
    """What an output line stores for its input line: the parsed request, or the raw text if malformed."""
    try:
        return {"request": parse_json_line(text)}
    except InvalidRequestError:
        return {"raw": text if text is not None else raw.decode("utf-8", "replace")}
