"""Accelerator out-of-memory during a request -> 503, with the memory given back so the server goes on."""

from __future__ import annotations

import contextlib
import gc
import logging
import traceback
from typing import Iterator

import torch

from app.errors import OutOfMemoryError

log = logging.getLogger("saker.worker")


def free_memory() -> None:
    """Collect dropped tensors (the failed request's KV cache) and return cached blocks to the driver."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def out_of_memory_as_503() -> Iterator[None]:
    """Turn ``torch.OutOfMemoryError`` (= ``torch.cuda.OutOfMemoryError``) raised in the body into a 503
    ``OutOfMemoryError`` for this request only. The frames of the failed generation (which hold its KV cache
    and logits) are cleared and dropped from the exception before the cache is emptied, so nothing keeps
    those tensors alive (the 503 may still name the OOM exception as its ``__context__``)."""
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
    raise OutOfMemoryError(
        "The server ran out of accelerator memory for this request and freed it again; "
        "retry, or ask for fewer tokens (prompt, max_tokens, n, best_of)"
    ) from None
