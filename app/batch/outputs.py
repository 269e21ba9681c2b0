"""Writing the outputs: what an existing output holds (``scan_output``: the lines answered, a torn last line),
cleaning it, opening it for appending under a lock, and whole lines written and fsync'ed."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.batch.inputs import fingerprint
from app.batch.signals import SignalGuard

if TYPE_CHECKING:
    from app.batch.files import BatchFile

log = logging.getLogger("saker.batch")


def _retryable(error: Any) -> bool:
    """Errors of the run (internal errors, out of memory, overload) are retried by a rerun; errors about the
    request (``invalid_request_error``) would only repeat and count as answered."""
    return not isinstance(error, dict) or error.get("type") != "invalid_request_error"


@dataclass
class OutputState:
    """What an existing output holds: the answered lines, and whether it needs cleaning before appending."""

    keep: list[bytes] = field(default_factory=list)  # the lines to keep, without their newline
    prints: dict[int, str] = field(default_factory=dict)  # line -> fingerprint of its request
    done: dict[int, bool] = field(default_factory=dict)  # line -> answered with a result (False: error)
    dirty: bool = False  # a torn last line or lines to drop


def scan_output(path: Path) -> OutputState:
    """Read an output without changing it. Lines to drop: a torn last line (a write cut short by power loss or
    SIGKILL), unreadable lines, repeated line numbers, and internal errors (to be retried)."""
    state = OutputState()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return state
    chunks = data.split(b"\n")
    state.dirty = bool(data) and not data.endswith(b"\n")
    for i, chunk in enumerate(chunks):
        if not chunk.strip():
            continue
        try:
            record = json.loads(chunk)
            number = record["line"]
            if not isinstance(number, int) or isinstance(number, bool):
                raise ValueError("line is not an integer")
        except (ValueError, KeyError, TypeError):
            if i != len(chunks) - 1:
                log.warning("%s: dropping unreadable line %d", path, i + 1)
            state.dirty = True
            continue
        if number in state.prints or ("error" in record and _retryable(record["error"])):
            state.dirty = True
            continue
        ident = {"raw": record["raw"]} if "raw" in record else {"request": record.get("request")}
        state.prints[number] = fingerprint(ident)
        state.done[number] = "result" in record
        state.keep.append(chunk)
    return state


def rewrite_output(path: Path, keep: list[bytes]) -> None:
    """Replace the output by the kept lines, atomically (a crash leaves the old file or the new one)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        handle.write(b"".join(line + b"\n" for line in keep))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def open_output(batch_file: BatchFile):
    """Open the output for appending, holding an exclusive lock (two runs on one file would answer lines twice);
    read what it holds under the lock and clean it if needed. None when another run holds the lock."""
    import fcntl

    batch_file.output.parent.mkdir(parents=True, exist_ok=True)
    while True:
        handle = open(batch_file.output, "ab")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return None
        except OSError as exc:  # a file system without locks: go on without one
            log.warning("cannot lock %s (%s); make sure no other run writes it", batch_file.output, exc)
        try:
            same = os.stat(batch_file.output).st_ino == os.fstat(handle.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # another run replaced the file after we opened it: lock the new one
            handle.close()
            continue
        state = scan_output(batch_file.output)
        if state.dirty:
            rewrite_output(batch_file.output, state.keep)
            handle.close()  # the lock was on the old file; take it on the new one
            continue
        batch_file.done = state.done
        return handle


def encode_record(record: dict) -> bytes:
    try:
        return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a \ud800 escape: keep it escaped
        return (json.dumps(record, ensure_ascii=True) + "\n").encode("ascii")


def write_lines(handle, records: list[dict], guard: SignalGuard) -> None:
    data = b"".join(encode_record(r) for r in records)
    with guard.writing_lines():
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
