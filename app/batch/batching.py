"""Grouping items by the token budget and handing a group to the engine at once: ``answer_group`` is the one place
that decides how a batch reaches the engine."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Iterator

from app.batch.lines import Item
from app.engine.errors import EngineError
from app.errors import APIError, InternalServerError, as_api_error

log = logging.getLogger("saker.batch")


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
    ``max_running_requests``), so that its scheduler decodes them in shared forward passes (continuous batching; a
    request joins as rows free up). This is the one place that decides how a batch reaches the engine.
    ``on_answer`` runs in the calling thread, in completion order."""
    start = time.perf_counter()
    running = service.worker.max_running_requests
    concurrency = min(len(items), max(1, running))
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
        item.result = service.complete(item.request, item.prepared).body
    except (APIError, EngineError) as exc:
        item.error = as_api_error(exc)
    except Exception as exc:
        log.exception("line %d failed", item.line)
        item.error = InternalServerError(f"{type(exc).__name__}: {exc}")
