"""A JSON body -> a request schema; the first problem becomes ``InvalidRequestError`` (400) with ``param`` naming
its field."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from app.errors import InvalidRequestError


def _lone_surrogate_field(value: Any, field: str | None = None) -> str | None:
    """The top-level field holding a string with a lone UTF-16 surrogate (JSON's ``"\\ud800"``), which is
    not Unicode: tokenizers and UTF-8 encoders fail on it. None when every string is valid."""
    stack = [(field, value)]
    while stack:
        name, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return name or "body"
        elif isinstance(item, dict):
            stack.extend((name or key, v) for key, v in item.items())
            stack.extend((name or key, key) for key in item)
        elif isinstance(item, list):
            stack.extend((name, v) for v in item)
    return None


def parse_request(model_cls: type[BaseModel], body: Any) -> BaseModel:
    """Validate a JSON body; the first problem becomes a 400 naming its field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object", param=None)
    bad = _lone_surrogate_field(body)
    if bad is not None:
        raise InvalidRequestError(
            f"{bad} holds a lone UTF-16 surrogate escape (such as \\ud800), which is not valid Unicode",
            param=None if bad == "body" else bad,
        )
    try:
        return model_cls.model_validate(_integral_numbers(body))
    except ValidationError as exc:
        raise _as_invalid_request(exc) from None


def _integral_numbers(value):
    """JSON has one number type: ``1.0`` is the integer 1 (JSON Schema says so, and some clients write integers
    so). Whole floats become ints before validation (float fields take ints as they are; ``1.5`` stays)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, dict):
        return {key: _integral_numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_integral_numbers(item) for item in value]
    return value


def _as_invalid_request(exc: ValidationError) -> InvalidRequestError:
    errors = exc.errors()
    first = errors[0]
    ctx_error = (first.get("ctx") or {}).get("error")
    if isinstance(ctx_error, InvalidRequestError):
        return ctx_error
    loc = [str(x) for x in first["loc"] if not isinstance(x, int)]
    # union members show up as extra loc parts ("str", "list[int]"); keep the field name only
    param = loc[0] if loc else None
    fields = {e["loc"][0] for e in errors if e["loc"]}
    if first["type"] == "missing":
        return InvalidRequestError(f"{param} is required", param=param)
    msg = first["msg"].removeprefix("Value error, ")
    if len(fields) == 1 and len(errors) > 1 and param in ("prompt", "stop", "logit_bias", "stop_token_ids"):
        msg = (
            {
                "prompt": "prompt must be a string, a list of strings, a list of token ids or a list of "
                "lists of token ids",
                "stop": "stop must be a string or a list of strings",
                "logit_bias": "logit_bias must map token ids to numbers",
                "stop_token_ids": "stop_token_ids must be a list of token ids",
            }[param]
            if first["type"] != "value_error"
            else msg
        )
    if param and not msg.startswith(param):
        msg = f"{param}: {msg}"
    return InvalidRequestError(msg, param=param)
