"""The run: every pending line of every input file read, grouped, answered and written in input order, with the
progress bar on stderr and the counts of the summary line (``Stats``)."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field

from app.batch.batching import answer_group, group_items
from app.batch.files import BatchFile
from app.batch.inputs import read_lines
from app.batch.lines import Item, make_item
from app.batch.outputs import open_output, write_lines
from app.batch.signals import SignalGuard

log = logging.getLogger("saker.batch")


@dataclass
class Stats:
    run_id: str
    seed: int | None
    files: list[BatchFile]
    errors_now: int = 0  # error lines written by this run (for the progress bar)
    prompt_tokens: int = 0  # this run's
    generated_tokens: int = 0  # this run's (completion tokens, best_of candidates included)
    started: float = field(default_factory=time.perf_counter)

    @property
    def run_time(self) -> float:
        return time.perf_counter() - self.started

    def counts(self) -> tuple[int, int, int]:
        """(input lines, lines answered with a result, lines with an error) over the outputs as they now are."""
        results = sum(1 for batch_file in self.files for ok in batch_file.done.values() if ok)
        errors = sum(1 for batch_file in self.files for ok in batch_file.done.values() if not ok)
        return sum(batch_file.lines for batch_file in self.files), results, errors

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


def run_files(
    service,
    batch_files: list[BatchFile],
    *,
    max_batch_tokens: int,
    seed: int | None,
    progress: bool,
    stats: Stats,
    guard: SignalGuard,
) -> list[BatchFile]:
    """Answer every pending line of every input file; returns the files skipped because another run holds their
    output.
    Interrupted propagates (the lines written so far are whole)."""
    bar = _progress(sum(f.pending for f in batch_files), disabled=not progress)

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
        for batch_file in batch_files:
            if not batch_file.pending and not batch_file.dirty:
                continue
            handle = open_output(batch_file)
            if handle is None:
                log.error("another run is writing %s: %s is left to it", batch_file.output, batch_file.input)
                skipped.append(batch_file)
                continue
            with handle:
                items = (
                    make_item(service, number, text, raw, seed=seed, source=batch_file.input.name)
                    for number, text, raw in read_lines(batch_file.input)
                    if number not in batch_file.done
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
                        batch_file.done[item.line] = item.error is None
                    show(len(group) - len(runnable))
    finally:
        bar.close()
    return skipped
