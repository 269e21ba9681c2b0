"""The HTTP blueprint: parse -> service -> JSON. Nothing else lives here (no torch)."""
from __future__ import annotations

import json

from flask import Blueprint, current_app, jsonify, request

from app.errors import InvalidRequestError, UnsupportedMediaTypeError
from app.protocol import CompletionRequest, parse_request

bp = Blueprint("api", __name__)


def _service():
    return current_app.extensions["saker.service"]


def json_body() -> object:
    """The request body as JSON; clear 4xx errors for a wrong content type or malformed JSON."""
    mimetype = request.mimetype or ""
    if mimetype and mimetype != "application/json" and not mimetype.endswith("+json"):
        raise UnsupportedMediaTypeError(f"Content-Type must be application/json, not {mimetype}")
    raw = request.get_data(cache=False)
    if not raw.strip():
        raise InvalidRequestError("the request body is empty; send a JSON object")
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None


def _reject_constant(name: str):
    """NaN and Infinity are not JSON (RFC 8259); Python's parser would take them and pass range checks."""
    raise ValueError(f"{name} is not a valid JSON number")


@bp.get("/health")
def health():
    _service().worker.require_ready()
    return jsonify({"status": "ok"})


@bp.get("/v1/models")
def list_models():
    return jsonify(_service().list_models())


@bp.get("/v1/models/<path:model_id>")
def get_model(model_id: str):
    return jsonify(_service().get_model(model_id))


@bp.post("/v1/completions")
def completions():
    body = parse_request(CompletionRequest, json_body())
    served = _service().complete(body)
    response = jsonify(served.body)
    t = served.timings
    response.headers["X-Saker-Queue-Ms"] = f"{t.queue_s * 1000:.3f}"
    response.headers["X-Saker-Prefill-Ms"] = f"{t.prefill_s * 1000:.3f}"
    response.headers["X-Saker-Decode-Ms"] = f"{t.decode_s * 1000:.3f}"
    response.headers["X-Saker-Tokens-Per-Second"] = f"{t.tokens_per_second:.3f}"
    return response
