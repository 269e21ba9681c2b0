"""The APIError family and the one mapping to the OpenAI error body.

Every error the server returns is ``{"error": {"message", "type", "param", "code"}}``. The HTTP side
(protocol, service, routes) raises one of these; ``app/__init__.py`` (``error_response``) turns it into the
response. The engine raises its own errors (``app/engine/errors.py``: plain data); ``from_engine`` is where each
becomes its status, headers and message, and ``engine_errors_as_api`` applies it where the service calls the
engine.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from app.engine.errors import (  # noqa: F401 - ConfigError is the settings' too
    ClientGone,
    ConfigError,
    ConstraintError,
    EngineError,
    EngineNotReady,
    EngineOutOfMemory,
    EngineStepFailed,
    QueueFull,
    QueueTimeout,
)


class APIError(Exception):
    """An error with an HTTP status and an OpenAI error body."""

    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequestError(APIError):
    """400: the request is malformed or out of range; ``param`` names the field."""

    status = 400
    type = "invalid_request_error"


class ContextLengthExceededError(InvalidRequestError):
    code = "context_length_exceeded"


class ModelNotFoundError(InvalidRequestError):
    status = 404
    code = "model_not_found"


class NotFoundError(InvalidRequestError):
    status = 404
    code = "not_found"


class MethodNotAllowedError(InvalidRequestError):
    status = 405
    code = "method_not_allowed"


class UnsupportedMediaTypeError(InvalidRequestError):
    status = 415
    code = "unsupported_media_type"


class RequestTooLargeError(InvalidRequestError):
    status = 413
    code = "request_too_large"


class AuthenticationError(APIError):
    """401: missing or wrong API key (OpenAI's shape: invalid_request_error / invalid_api_key)."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class OverloadedError(APIError):
    status = 429
    type = "server_overloaded"
    code = "model_overloaded"


class ServiceUnavailableError(APIError):
    status = 503
    type = "service_unavailable"
    code = "service_unavailable"


class ModelNotReadyError(ServiceUnavailableError):
    code = "model_not_ready"

    def __init__(self, message: str, **kwargs):
        kwargs.setdefault("headers", {"Retry-After": "5"})
        super().__init__(message, **kwargs)


class QueueTimeoutError(ServiceUnavailableError):
    """503: the request waited longer than SAKER_QUEUE_TIMEOUT for the model."""

    code = "queue_timeout"


class OutOfMemoryError(ServiceUnavailableError):
    """503: the accelerator ran out of memory during this request; the cache was freed, the server goes on."""

    code = "out_of_memory"

    def __init__(self, message: str, **kwargs):
        kwargs.setdefault("headers", {"Retry-After": "1"})
        super().__init__(message, **kwargs)


class ClientClosedError(APIError):
    """499 (nginx's "client closed request"): the client of a plain request went away while it was generated;
    generation stopped at the next step. Nobody reads the answer; the access log records it."""

    status = 499
    type = "client_closed_request"
    code = "client_closed_request"


class InternalServerError(APIError):
    status = 500
    type = "server_error"
    code = "internal_error"


class EngineFailedError(InternalServerError):
    """500: a step of the engine failed while it computed this request. Its message names the request id, which
    a stream's generator (outside the request's context) fills in when it answers (``named``)."""

    def __init__(self, template: str, request_id: str | None):
        self.template = template
        super().__init__(template.format(request_id=request_id or "?"))
        self.request_id = request_id

    def named(self, request_id: str) -> "EngineFailedError":
        return self if self.request_id else EngineFailedError(self.template, request_id)


def from_engine(exc: EngineError, request_id: str | None = None) -> APIError:
    """The answer to a request the engine could not serve: its status, headers, code and message."""
    if isinstance(exc, QueueFull):
        return OverloadedError(
            f"The model is overloaded: {exc.waiting} requests are already waiting for it, the most "
            f"allowed (SAKER_MAX_QUEUE={exc.limit}). Retry after {exc.retry_after_s} s.",
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    if isinstance(exc, QueueTimeout):
        return QueueTimeoutError(
            f"The model is overloaded: this request waited {exc.limit_s:g} s for its turn, the "
            f"longest allowed (SAKER_QUEUE_TIMEOUT={exc.limit_s:g}). Retry after {exc.retry_after_s} s.",
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    if isinstance(exc, EngineOutOfMemory):
        return OutOfMemoryError(
            "The server ran out of accelerator memory for this request and freed it again; "
            "retry, or ask for fewer tokens (prompt, max_tokens, n, best_of)"
        )
    if isinstance(exc, EngineNotReady):
        return ModelNotReadyError(exc.reason)
    if isinstance(exc, ClientGone):
        err = ClientClosedError("the client closed the connection; generation stopped")
        err.timings = exc.timings  # what was done before it stopped, for the access log
        return err
    if isinstance(exc, ConstraintError):  # the service names the field that asked (param) where it knows it
        return InvalidRequestError(exc.detail)
    if isinstance(exc, EngineStepFailed):
        after = (
            "the engine could not recover and this worker is being replaced; retry"
            if exc.fatal
            else "what it held was given back and the server serves on; retry"
        )
        return EngineFailedError(
            f"The engine failed on this request (request id {{request_id}}): {exc}; {after}",
            request_id or _request_id(),
        )
    return InternalServerError(f"The engine could not serve this request: {exc}")


def _request_id() -> str | None:
    """The current request's id (``X-Request-ID``), None outside a request's context."""
    from flask import g, has_request_context

    return getattr(g, "request_id", None) if has_request_context() else None


def as_api_error(exc: APIError | EngineError, request_id: str | None = None) -> APIError:
    """An API error as it is; an engine error as the HTTP layer answers it (``request_id``: the request's, where
    it is answered outside the request's context: a stream's generator)."""
    err = exc if isinstance(exc, APIError) else from_engine(exc, request_id)
    return err.named(request_id) if request_id and isinstance(err, EngineFailedError) else err


@contextlib.contextmanager
def engine_errors_as_api() -> Iterator[None]:
    """Around calls into the engine (a generator's body too): an engine error leaves as its API error."""
    try:
        yield
    except EngineError as exc:
        raise from_engine(exc) from None
