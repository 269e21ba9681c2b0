"""Accelerator out-of-memory during a request -> ``EngineOutOfMemory`` for that request, with the memory given
back so the server goes on."""

from __future__ import annotations

import contextlib
import gc
import logging
import traceback
from typing import Iterator

import torch

from app.engine.errors import EngineOutOfMemory

log = logging.getLogger("saker.worker")


def free_memory() -> None:
    """Collect dropped tensors (the failed request's KV cache) and return cached blocks to the driver."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def out_of_memory_guard() -> Iterator[None]:
    """Turn ``torch.OutOfMemoryError`` (= ``torch.cuda.OutOfMemoryError``) raised in the body into
    ``EngineOutOfMemory`` for this request only. The frames of the failed generation (which hold its KV cache
    and logits) are cleared and dropped from the exception before the cache is emptied, so nothing keeps
    those tensors alive (the new error keeps no reference to the old one)."""
    detail = None
    try:
        yield
    except torch.OutOfMemoryError as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        traceback.clear_frames(exc.__traceback__)
        exc.__traceback__ = None
        del exc
    if detail is None:
        return
    free_memory()
    log.error("out of memory during a request (%s); cache freed, serving on", detail)
    raise EngineOutOfMemory(detail) from None
