"""The APIError family and the one mapping to the OpenAI error body.

Every error the server returns is ``{"error": {"message", "type", "param", "code"}}``. Code anywhere
(protocol, service, engine) raises one of these; ``app/__init__.py`` (``error_response``) turns it into
the response.
"""

from __future__ import annotations


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


class ConfigError(Exception):
    """A bad setting or an impossible load: reported at start-up as one line."""
