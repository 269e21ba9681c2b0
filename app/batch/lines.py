"""Each input line as a request (``Item``): parsed, validated and prepared by the service before any batch runs
(an error is known then), with the tokens it holds in a batch. No model work here."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

from app.batch.inputs import parse_json_line
from app.engine.errors import EngineError
from app.errors import APIError, InternalServerError, InvalidRequestError, as_api_error
from app.protocol import ChatCompletionRequest, CompletionRequest, parse_request

log = logging.getLogger("saker.batch")

# Fields the batch runner drops before validation: a file cannot be streamed back.
_IGNORED_FIELDS = ("stream", "stream_options")


@dataclass
class Item:
    """One input line: a valid request to run, or an error already known."""

    line: int
    record: dict  # the output line under construction: line, request/raw
    kind: str = "completion"  # completion | chat
    request: Any = None  # the validated request (None when error is set)
    error: APIError | None = None
    cost: int = 0  # tokens it occupies in a batch
    prepared: Any = None  # the request prepared for the engine (service.prepare), done once
    result: dict | None = None


def derived_seed(base: int, name: str, line: int) -> int:
    digest = hashlib.sha256(f"{base}:{name}:{line}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def make_item(service, number: int, text: str | None, raw: bytes, *, seed: int | None, source: str) -> Item:
    """Parse and validate one line (errors become an Item with ``error``); no model work here."""
    try:
        body = parse_json_line(text)
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
        item.prepared = service.prepare(item.request)
        item.cost = request_cost(service, item.prepared)
    except (APIError, EngineError) as exc:
        item.error, item.request = as_api_error(exc), None
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


def request_cost(service, prepared) -> int:
    """Tokens a prepared request holds in a batch: (prompt tokens + max_tokens) per sequence (n, or best_of
    candidates), as the seed's ``--budget``; max_tokens null counts up to the context. ``service.prepare`` has
    checked the request against the model (context length, limits), so those errors are known before any batch
    runs."""
    params = prepared.params
    total = service.max_total_tokens
    return sum(
        params.num_candidates
        * (len(ids) + (max(total - len(ids), 0) if params.max_tokens is None else params.max_tokens))
        for ids in prepared.prompts
    )
