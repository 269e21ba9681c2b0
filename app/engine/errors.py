"""What the engine tells a request that it could not serve: plain data, no HTTP.

The engine (admission, the scheduler's tickets, the out-of-memory guard, the worker) raises these; the HTTP
layer (``app.errors.from_engine``) turns each into its status, headers, error body and message (the messages
that name ``SAKER_*`` settings are written there). Each one pickles with its fields, so it crosses the engine
process's pipe (``SAKER_ENGINE_PROCESS``) as it is. No torch and no Flask here.
"""

from __future__ import annotations


class ConfigError(Exception):
    """A bad setting or an impossible load: reported at start-up as one line (the settings raise it too)."""


class EngineError(Exception):
    """A request the engine could not serve, and why, as data."""

    def __init__(self, *fields):
        super().__init__(*fields)  # the constructor's arguments: what pickling rebuilds the error from


class QueueFull(EngineError):
    """Admission's queue already holds ``limit`` waiting requests (``waiting`` of them); nothing was queued."""

    def __init__(self, waiting: int, limit: int, retry_after_s: int):
        super().__init__(waiting, limit, retry_after_s)
        self.waiting, self.limit, self.retry_after_s = waiting, limit, retry_after_s

    def __str__(self) -> str:
        return f"queue full: {self.waiting} waiting, at most {self.limit}; retry after {self.retry_after_s} s"


class QueueTimeout(EngineError):
    """The request waited ``waited_s`` for a slot, past admission's ``limit_s``, and left the queue."""

    def __init__(self, waited_s: float, limit_s: float, retry_after_s: int):
        super().__init__(waited_s, limit_s, retry_after_s)
        self.waited_s, self.limit_s, self.retry_after_s = waited_s, limit_s, retry_after_s

    def __str__(self) -> str:
        return (
            f"waited {self.waited_s:.3f} s for a slot, at most {self.limit_s:g} s; retry after {self.retry_after_s} s"
        )


class EngineOutOfMemory(EngineError):
    """The accelerator ran out of memory during this request; its memory was freed and the engine goes on.
    ``detail``: the first line of the original error."""

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail

    def __str__(self) -> str:
        return f"out of memory: {self.detail}"


class EngineStepFailed(EngineError):
    """A step that computed this request failed (``detail``: the error in one line). The request's blocks, rows
    and slot were given back and the engine serves the others on; or, when ``fatal``, the engine could not be
    brought back to a consistent state and its process is about to be replaced."""

    def __init__(self, detail: str, fatal: bool = False):
        super().__init__(detail, fatal)
        self.detail, self.fatal = detail, fatal

    def __str__(self) -> str:
        return self.detail


class EngineNotReady(EngineError):
    """The model is not there to serve: still loading, failed to load, or its engine process is gone."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


class ClientGone(EngineError):
    """The request's client went away while it waited or was generated; the request was cancelled. The worker
    adds ``timings`` (what was done before it stopped)."""

    timings = None

    def __str__(self) -> str:
        return "the client went away; generation stopped"


class ConstraintError(EngineError):
    """A structured-output constraint the grammar engine cannot take; ``detail`` is its message."""

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail

    def __str__(self) -> str:
        return self.detail
