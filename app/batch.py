"""``python -m app batch``: push JSONL files of OpenAI-style requests through the model offline.

Each input line is a ``/v1/completions`` body (or a chat body with ``messages``); each answer is one output line
``{"line": N, "request": <as read>, "result": <the server's JSON + request_time>}`` or, for a malformed line or an
invalid request, ``{"line": N, "request": ..., "error": <OpenAI error object>}``. Requests go through the same
``CompletionService`` the HTTP server uses, in process, so results are the JSON the server would return.

- Outputs are resumable: every output line stores its input line number; a rerun skips the lines already answered
  (results and request errors; internal errors, out-of-memory and overload errors are retried) and appends the
  rest.
- Lines are written whole: each group's lines in one write, flushed and fsync'ed; SIGINT/SIGTERM are deferred
  while a write is in progress, and a torn last line (power loss, SIGKILL) is cut off on the next run.
- Requests are grouped by a token budget (``--max-batch-tokens``, the engine's setting of that name); ``answer_group``
  hands one group to the engine at once, whose scheduler decodes its requests in shared forward passes.
- stdout holds one JSON summary line (the last line); the progress bar and logs go to stderr.
- Exit codes: 0 every line answered, 1 some lines hold errors (or the run failed), 2 usage or set-up error
  (nothing was run), 128+signal when interrupted.

No torch import at module level: the parser is built by ``python -m app`` for every command.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import json
import logging
import os
import queue
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

from app.errors import APIError, ConfigError, InternalServerError, InvalidRequestError
from app.protocol import ChatCompletionRequest, CompletionRequest, parse_request

log = logging.getLogger("saker.batch")

DEFAULT_MAX_BATCH_TOKENS = 8192
EXIT_OK, EXIT_ERRORS, EXIT_USAGE = 0, 1, 2
# Fields the batch runner drops before validation: a file cannot be streamed back.
_IGNORED_FIELDS = ("stream", "stream_options")


class UsageError(Exception):
    """Bad arguments or inputs: one line on stderr, exit code 2, nothing run."""


class Interrupted(BaseException):
    """SIGINT/SIGTERM arrived (BaseException so that per-request ``except Exception`` does not swallow it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


# -- arguments ----------------------------------------------------------------------------------------------
def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


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
    # --max-batch-tokens is the setting of that name (generated above): the same token budget the server's
    # batches use; here it defaults to DEFAULT_MAX_BATCH_TOKENS.
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


# -- inputs and outputs ---------------------------------------------------------------------------------------
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


def output_name(path: Path) -> str:
    """``request_3.jsonl`` -> ``output_request_3.jsonl`` (Together's naming)."""
    return f"output_{path.stem}.jsonl"


@dataclass
class Job:
    input: Path
    output: Path
    lines: int = 0  # non-blank input lines
    done: dict[int, bool] = field(default_factory=dict)  # line -> answered with a result (False: error)
    pending: int = 0
    dirty: bool = False  # its output needs cleaning (see scan_output)


def plan_jobs(patterns: list[str], output: str | None, output_dir: str | None) -> list[Job]:
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
    jobs = []
    for path, out in zip(inputs, outputs):
        if path.resolve() in output_set and path.resolve() != out.resolve():
            print(f"saker batch: skipping {path}: it is the output of another input", file=sys.stderr)
            continue
        jobs.append(Job(path, out))
    seen: dict[Path, Path] = {}
    for job in jobs:
        if job.output.resolve() == job.input.resolve():
            raise UsageError(f"the output {job.output} is the input itself")
        other = seen.setdefault(job.output.resolve(), job.input)
        if other is not job.input:
            raise UsageError(f"inputs {other} and {job.input} would both write {job.output}")
    if not jobs:
        raise UsageError("no input files left to answer")
    return jobs


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


def parse_line(text: str | None) -> Any:
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


def _identity(text: str | None, raw: bytes) -> Any:
    """What an output line stores for its input line: the parsed request, or the raw text if malformed."""
    try:
        return {"request": parse_line(text)}
    except InvalidRequestError:
        return {"raw": text if text is not None else raw.decode("utf-8", "replace")}


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


def open_output(job: Job):
    """Open the output for appending, holding an exclusive lock (two runs on one file would answer lines twice);
    read what it holds under the lock and clean it if needed. None when another run holds the lock."""
    import fcntl

    job.output.parent.mkdir(parents=True, exist_ok=True)
    while True:
        handle = open(job.output, "ab")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return None
        except OSError as exc:  # a file system without locks: go on without one
            log.warning("cannot lock %s (%s); make sure no other run writes it", job.output, exc)
        try:
            same = os.stat(job.output).st_ino == os.fstat(handle.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # another run replaced the file after we opened it: lock the new one
            handle.close()
            continue
        state = scan_output(job.output)
        if state.dirty:
            rewrite_output(job.output, state.keep)
            handle.close()  # the lock was on the old file; take it on the new one
            continue
        job.done = state.done
        return handle


def check_job(job: Job) -> None:
    """Count the input's lines, and check that the lines already answered are the ones in the input."""
    state = scan_output(job.output)
    job.done, job.dirty = state.done, state.dirty
    job.lines = job.pending = 0
    numbers = set()
    for number, text, raw in read_lines(job.input):
        job.lines += 1
        numbers.add(number)
        if number not in state.prints:
            job.pending += 1
        elif state.prints[number] != fingerprint(_identity(text, raw)):
            raise UsageError(
                f"{job.output} line for input line {number} holds another request than "
                f"{job.input}: the input changed since that output was written; move the output "
                f"away (or use --output-dir) to start afresh"
            )
    extra = sorted(set(state.prints) - numbers)
    if extra:
        raise UsageError(
            f"{job.output} answers line {extra[0]}, which {job.input} does not have: "
            f"the input changed since that output was written"
        )


# -- requests --------------------------------------------------------------------------------------------------
@dataclass
class Item:
    """One input line: a valid request to run, or an error already known."""

    line: int
    record: dict  # the output line under construction: line, request/raw
    kind: str = "completion"  # completion | chat
    request: Any = None  # the validated request (None when error is set)
    error: APIError | None = None
    cost: int = 0  # tokens it occupies in a batch
    job: Any = None  # the request prepared for the engine (service.prepare), done once
    result: dict | None = None


def derived_seed(base: int, name: str, line: int) -> int:
    digest = hashlib.sha256(f"{base}:{name}:{line}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def make_item(service, number: int, text: str | None, raw: bytes, *, seed: int | None, source: str) -> Item:
    """Parse and validate one line (errors become an Item with ``error``); no model work here."""
    try:
        body = parse_line(text)
    except InvalidRequestError as exc:
        return Item(
            number,
            {"line": number, "request": None, "raw": text if text is not None else raw.decode("utf-8", "replace")},
            error=exc,
        )
    item = Item(number, {"line": number, "request": body})
    try:
        if not isinstance(body, dict):
            raise InvalidRequestError("each line must be a JSON object (a request body)")
        body = {k: v for k, v in body.items() if k not in _IGNORED_FIELDS}
        if seed is not None and body.get("seed") is None:
            body["seed"] = derived_seed(seed, source, number)
        if "messages" in body:
            item.kind = "chat"
            request = parse_request(ChatCompletionRequest, body)
        else:
            request = parse_request(CompletionRequest, body)
        item.request = _served_model(service, request)
        item.job = service.prepare(item.request)
        item.cost = job_cost(service, item.job)
    except APIError as exc:
        item.error, item.request = exc, None
    except Exception as exc:
        log.exception("line %d: validation failed", number)
        item.error, item.request = InternalServerError(f"{type(exc).__name__}: {exc}"), None
    return item


def _served_model(service, request):
    """``model``/``engine`` are informational in a batch: the loaded model answers. A named PEFT adapter or an
    alias of the model is kept (it is served); any other name falls back to the main model."""
    name = getattr(request, "model", None)
    if name is None:
        name = getattr(request, "engine", None)
    if name is None:
        return request
    served = set(service.names) | set(service.worker.require_ready().adapters)
    if name in served:
        return request
    update = {"model": None}
    if "engine" in type(request).model_fields:
        update["engine"] = None
    return request.model_copy(update=update)


def job_cost(service, job) -> int:
    """Tokens a prepared request holds in a batch: (prompt tokens + max_tokens) per sequence (n, or best_of
    candidates), as the seed's ``--budget``; max_tokens null counts up to the context. ``service.prepare`` has
    checked the request against the model (context length, limits), so those errors are known before any batch
    runs."""
    params = job.params
    total = service.max_total_tokens
    return sum(
        params.num_candidates
        * (len(ids) + (max(total - len(ids), 0) if params.max_tokens is None else params.max_tokens))
        for ids in job.prompts
    )


def group_items(items: Iterator[Item], max_tokens: int) -> Iterator[list[Item]]:
    """Consecutive items in groups whose requests fit the token budget (a request over it goes alone). Lines with
    an error ride along with their neighbours so that output stays in input order."""
    group: list[Item] = []
    used = 0
    for item in items:
        if item.error is None and group and used + item.cost > max_tokens and any(i.error is None for i in group):
            yield group
            group, used = [], 0
        group.append(item)
        used += item.cost
    if group:
        yield group


def answer_group(service, items: list[Item], on_answer: Callable[[Item], None] | None = None) -> float:
    """Answer one batch: fills ``item.result`` or ``item.error`` for each request; returns the batch's seconds.

    The batch's requests go to the engine together: up to as many at once as the worker admits (its
    ``max_batch_size``), so that its scheduler decodes them in shared forward passes (continuous batching; a
    request joins as rows free up). This is the one place that decides how a batch reaches the engine.
    ``on_answer`` runs in the calling thread, in completion order."""
    start = time.perf_counter()
    admission = getattr(getattr(service, "worker", None), "admission", None)
    concurrency = min(len(items), max(1, getattr(admission, "capacity", 1)))
    if concurrency <= 1:
        for item in items:
            _answer(service, item)
            if on_answer is not None:
                on_answer(item)
        return time.perf_counter() - start
    todo = iter(items)
    lock = threading.Lock()
    stop = threading.Event()
    finished: queue.SimpleQueue = queue.SimpleQueue()

    def work() -> None:
        while not stop.is_set():
            with lock:
                item = next(todo, None)
            if item is None:
                return
            _answer(service, item)
            finished.put(item)

    # daemon threads: after SIGINT/SIGTERM the requests in flight must not keep the process alive
    for i in range(concurrency):
        threading.Thread(target=work, name=f"saker-batch-{i}", daemon=True).start()
    try:
        for _ in items:
            while True:
                try:
                    item = finished.get(timeout=0.25)  # a timeout: signals are handled while waiting
                    break
                except queue.Empty:
                    continue
            if on_answer is not None:
                on_answer(item)
    finally:
        stop.set()  # interrupted: start nothing more
    return time.perf_counter() - start


def _answer(service, item: Item) -> None:
    try:
        item.result = service.complete(item.request, item.job).body
    except APIError as exc:
        item.error = exc
    except Exception as exc:
        log.exception("line %d failed", item.line)
        item.error = InternalServerError(f"{type(exc).__name__}: {exc}")


# -- writing --------------------------------------------------------------------------------------------------
def encode_record(record: dict) -> bytes:
    try:
        return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a \ud800 escape: keep it escaped
        return (json.dumps(record, ensure_ascii=True) + "\n").encode("ascii")


class SignalGuard:
    """SIGINT/SIGTERM raise ``Interrupted`` at once, except while lines are written: then after the write."""

    def __init__(self):
        self.writing = False
        self.pending: int | None = None
        self.previous: dict[int, Any] = {}

    def _handler(self, signum, frame):
        if self.writing:
            self.pending = signum
            return
        raise Interrupted(signum)

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                self.previous[signum] = signal.signal(signum, self._handler)
            except ValueError:  # not the main thread: leave signals alone
                pass

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}

    @contextlib.contextmanager
    def writing_lines(self):
        self.writing = True
        try:
            yield
        finally:
            self.writing = False
        if self.pending is not None:
            signum, self.pending = self.pending, None
            raise Interrupted(signum)


def write_lines(handle, records: list[dict], guard: SignalGuard) -> None:
    data = b"".join(encode_record(r) for r in records)
    with guard.writing_lines():
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


# -- the run --------------------------------------------------------------------------------------------------
@dataclass
class Stats:
    run_id: str
    seed: int | None
    jobs: list[Job]
    errors_now: int = 0  # error lines written by this run (for the progress bar)
    prompt_tokens: int = 0  # this run's
    generated_tokens: int = 0  # this run's (completion tokens, best_of candidates included)
    started: float = field(default_factory=time.perf_counter)

    @property
    def run_time(self) -> float:
        return time.perf_counter() - self.started

    def counts(self) -> tuple[int, int, int]:
        """(input lines, lines answered with a result, lines with an error) over the outputs as they now are."""
        results = sum(1 for job in self.jobs for ok in job.done.values() if ok)
        errors = sum(1 for job in self.jobs for ok in job.done.values() if not ok)
        return sum(job.lines for job in self.jobs), results, errors

    def summary(self, status: str) -> dict:
        run_time = self.run_time
        requests, responses, errors = self.counts()
        return {
            "status": status,
            "run_id": self.run_id,
            "request_count": requests,
            "response_count": responses,
            "error_count": errors,
            "run_time_sec": round(run_time, 3),
            "prompt_tokens": self.prompt_tokens,
            "total_tokens_generated": self.generated_tokens,
            "tokens_per_sec": round(self.generated_tokens / run_time, 3) if run_time > 0 else 0.0,
            "seed": self.seed,
        }


def _progress(total: int, disabled: bool):
    from tqdm import tqdm

    interactive = sys.stderr.isatty()
    return tqdm(
        total=total,
        unit="req",
        file=sys.stderr,
        disable=disabled,
        dynamic_ncols=interactive,
        mininterval=0.5 if interactive else 30.0,
        desc="batch",
    )


def run_jobs(
    service,
    jobs: list[Job],
    *,
    max_batch_tokens: int,
    seed: int | None,
    progress: bool,
    stats: Stats,
    guard: SignalGuard,
) -> list[Job]:
    """Answer every pending line of every job; returns the jobs skipped because another run holds their output.
    Interrupted propagates (the lines written so far are whole)."""
    bar = _progress(sum(j.pending for j in jobs), disabled=not progress)

    def show(done: int) -> None:
        run_time = stats.run_time
        bar.set_postfix_str(
            f"{stats.generated_tokens / run_time if run_time else 0:.1f} tok/s, {stats.errors_now} errors",
            refresh=False,
        )
        bar.update(done)

    def on_answer(item: Item) -> None:
        if item.result is not None:
            usage = item.result.get("usage") or {}
            stats.prompt_tokens += usage.get("prompt_tokens", 0)
            stats.generated_tokens += usage.get("completion_tokens", 0)
        show(1)

    skipped = []
    try:
        for job in jobs:
            if not job.pending and not job.dirty:
                continue
            handle = open_output(job)
            if handle is None:
                log.error("another run is writing %s: %s is left to it", job.output, job.input)
                skipped.append(job)
                continue
            with handle:
                items = (
                    make_item(service, number, text, raw, seed=seed, source=job.input.name)
                    for number, text, raw in read_lines(job.input)
                    if number not in job.done
                )
                for group in group_items(items, max_batch_tokens):
                    runnable = [i for i in group if i.error is None]
                    seconds = answer_group(service, runnable, on_answer) if runnable else 0.0
                    records = []
                    for item in group:
                        record = dict(item.record)
                        if item.error is None:
                            record["result"] = {
                                **item.result,
                                "request_time": {"batch_time": seconds, "batch_size": len(runnable)},
                            }
                        else:
                            record["error"] = item.error.body()["error"]
                            stats.errors_now += 1
                        records.append(record)
                    write_lines(handle, records, guard)
                    for item in group:
                        job.done[item.line] = item.error is None
                    show(len(group) - len(runnable))
    finally:
        bar.close()
    return skipped


def _load_service(settings, worker=None):
    from app.engine.worker import Worker
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
        jobs = plan_jobs(args.inputs, args.output, args.output_dir)
        for job in jobs:
            check_job(job)
        for job in jobs:
            if job.pending:
                target = job.output.parent
                while not target.exists() and target != target.parent:
                    target = target.parent
                if not os.access(target, os.W_OK):
                    raise UsageError(f"cannot write {job.output}: {target} is not writable")
    except (UsageError, ConfigError) as exc:
        print(f"saker batch: {exc}", file=sys.stderr)
        return EXIT_USAGE

    stats = Stats(run_id, args.seed, jobs)
    requests = stats.counts()[0]
    pending = sum(j.pending for j in jobs)
    log.info(
        "%d input file(s), %d request line(s), %d already answered, %d to run",
        len(jobs),
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
        if pending or any(job.dirty for job in jobs):
            stats.started = time.perf_counter()
            budget = settings.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS
            skipped = run_jobs(
                service,
                jobs,
                max_batch_tokens=budget,
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


if __name__ == "__main__":
    sys.exit(main())
