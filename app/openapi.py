"""``GET /openapi.json``: an OpenAPI 3.1 document assembled from the pydantic models in ``app/protocol/``.

Only the route table below is written by hand (which model each route takes and returns); every schema is
``model_json_schema`` output, so the document cannot drift from the validation the server does. A test checks
that the table covers every route of the app.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from flask import Flask, jsonify
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from app import protocol as p
from app.responses import ResponsesRequest

OPENAPI_VERSION = "3.1.0"
_REF = "#/components/schemas/{model}"
_ERROR_STATUSES = {
    "400": "Invalid request (param names the field)",
    "401": "Missing or wrong API key (when keys are configured)",
    "404": "Unknown model or route",
    "413": "Request body over SAKER_MAX_REQUEST_BYTES",
    "415": "Content-Type is not JSON",
    "429": "Model is overloaded: more than SAKER_MAX_QUEUE requests waiting (Retry-After)",
    "500": "Internal error (the message holds the request id)",
    "503": "Model not ready, waited over SAKER_QUEUE_TIMEOUT, or out of accelerator memory (Retry-After)",
}


@dataclass(frozen=True)
class Operation:
    path: str  # Flask rule, e.g. /v1/models/<path:model_id>
    method: str
    summary: str
    request: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    response_type: str = "application/json"  # or text/plain for /metrics
    streams: bool = False  # answers text/event-stream with "stream": true
    protected: bool = False  # needs the API key when keys are configured
    errors: tuple[str, ...] = ("401", "500", "503")


SSE_EVENT = {
    "type": "object",
    "description": "One server-sent event: `data` is a JSON chunk, an error frame or `[DONE]`.",
    "required": ["data"],
    "properties": {
        "data": {"type": "string"},
        "event": {"type": "string", "description": "message, or a Responses event's type"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}

OPERATIONS: tuple[Operation, ...] = (
    Operation(
        "/v1/completions",
        "post",
        "Create a completion",
        p.CompletionRequest,
        p.CompletionResponse,
        streams=True,
        protected=True,
        errors=("400", "401", "404", "413", "415", "429", "500", "503"),
    ),
    Operation(
        "/v1/chat/completions",
        "post",
        "Create a chat completion",
        p.ChatCompletionRequest,
        p.ChatCompletionResponse,
        streams=True,
        protected=True,
        errors=("400", "401", "404", "413", "415", "429", "500", "503"),
    ),
    Operation("/v1/models", "get", "List the served models", response=p.ModelList, protected=True),
    Operation(
        "/v1/models/<path:model_id>",
        "get",
        "One served model",
        response=p.ModelCard,
        protected=True,
        errors=("401", "404", "500", "503"),
    ),
    Operation(
        "/tokenize",
        "post",
        "Tokenize a prompt or chat messages",
        p.TokenizeRequest,
        p.TokenizeResponse,
        protected=True,
        errors=("400", "401", "404", "413", "415", "500", "503"),
    ),
    Operation(
        "/detokenize",
        "post",
        "Token ids to text",
        p.DetokenizeRequest,
        p.DetokenizeResponse,
        protected=True,
        errors=("400", "401", "404", "413", "415", "500", "503"),
    ),
    Operation(
        "/tokenizer_info",
        "get",
        "The tokenizer's special tokens, sizes and chat template",
        response=p.TokenizerInfo,
        protected=True,
    ),
    Operation(
        "/v1/responses",
        "post",
        "Create a response (the Responses API, on the chat path)",
        ResponsesRequest,
        streams=True,
        protected=True,
        errors=("400", "401", "404", "413", "415", "429", "500", "503"),
    ),
    Operation("/v1/responses/<response_id>", "get", "A stored response", protected=True, errors=("401", "404", "500")),
    Operation(
        "/v1/responses/<response_id>",
        "delete",
        "Delete a stored response",
        protected=True,
        errors=("401", "404", "500"),
    ),
    Operation(
        "/health",
        "get",
        "Readiness: 200 once the model is loaded, 503 before",
        response=p.HealthResponse,
        errors=("503",),
    ),
    Operation("/livez", "get", "Liveness: 200 while the process serves", response=p.HealthResponse, errors=()),
    Operation(
        "/readyz",
        "get",
        "Readiness: 200 once the model is loaded and the replica is not stopping",
        response=p.HealthResponse,
        errors=("503",),
    ),
    Operation(
        "/metrics", "get", "Prometheus metrics (text exposition format)", response_type="text/plain", errors=("401",)
    ),
    Operation("/openapi.json", "get", "This document", response_type="application/json", errors=()),
)


def openapi_path(rule: str) -> tuple[str, list[str]]:
    """Flask rule -> OpenAPI path template and its parameter names (``<path:model_id>`` -> ``{model_id}``)."""
    names: list[str] = []

    def repl(match: re.Match) -> str:
        names.append(match.group(2))
        return "{" + match.group(2) + "}"

    return re.sub(r"<(?:([a-z]+):)?([A-Za-z_][A-Za-z0-9_]*)>", repl, rule), names


def build_openapi(title: str = "saker", version: str = "1") -> dict:
    models: list[tuple[type[BaseModel], str]] = [(p.ErrorResponse, "serialization")]
    for op in OPERATIONS:
        if op.request is not None:
            models.append((op.request, "validation"))
        if op.response is not None:
            models.append((op.response, "serialization"))
    refs, defs = models_json_schema(list(dict.fromkeys(models)), ref_template=_REF)
    error_ref = refs[(p.ErrorResponse, "serialization")]

    paths: dict[str, dict] = {}
    for op in OPERATIONS:
        path, params = openapi_path(op.path)
        operation: dict = {
            "summary": op.summary,
            "operationId": re.sub(r"\W+", "_", f"{op.method}{path}").strip("_"),
            "responses": {},
        }
        if params:
            operation["parameters"] = [
                {"name": name, "in": "path", "required": True, "schema": {"type": "string"}} for name in params
            ]
        if op.request is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": refs[(op.request, "validation")]}},
            }
        ok: dict = {"description": "OK"}
        if op.response is not None:
            ok["content"] = {"application/json": {"schema": refs[(op.response, "serialization")]}}
        else:
            ok["content"] = {
                op.response_type: {
                    "schema": {"type": "string"} if op.response_type != "application/json" else {"type": "object"}
                }
            }
        if op.streams:
            # in OpenAPI 3.1 the schema of text/event-stream describes one event (3.2 adds itemSchema): its
            # fields as an SSE parser gives them; each data is a JSON chunk or [DONE] (described in words)
            ok["content"]["text/event-stream"] = {"schema": SSE_EVENT}
            ok["description"] = 'OK. With "stream": true, text/event-stream: ' + (
                "`event: <type>` + `data: {event}` frames (Responses events), the last one response.completed, "
                "response.incomplete or response.failed."
                if op.path == "/v1/responses"
                else "`data: {chunk}` frames shaped like the response (choices carry text or a delta), an optional "
                'usage chunk, then `data: [DONE]`. An error after the first frame is a `data: {"error": ...}` '
                "frame."
            )
        operation["responses"]["200"] = ok
        for status in op.errors:
            headers = {"Retry-After": {"schema": {"type": "integer"}}} if status in ("429", "503") else None
            answer: dict = {
                "description": _ERROR_STATUSES[status],
                "content": {"application/json": {"schema": error_ref}},
            }
            if headers:
                answer["headers"] = headers
            operation["responses"][status] = answer
        if op.protected:
            operation["security"] = [{"bearerAuth": []}]
        paths.setdefault(path, {})[op.method] = operation

    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": title,
            "version": version,
            "description": "OpenAI-compatible completion server over Hugging Face transformers. Schemas are "
            "generated from saker's pydantic models.",
        },
        "paths": paths,
        "components": {
            "schemas": defs.get("$defs", {}),
            "securitySchemes": {
                "bearerAuth": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "Needed when SAKER_API_KEYS or SAKER_API_KEY_FILE is set",
                }
            },
        },
    }


def install_openapi(app: Flask) -> None:
    document = build_openapi()
    app.add_url_rule("/openapi.json", "openapi", lambda: jsonify(document), methods=["GET"])
