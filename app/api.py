"""The HTTP blueprint: parse -> service -> JSON. Nothing else lives here (no torch)."""

from __future__ import annotations

import itertools
import json
import logging
import re

from flask import Blueprint, Response, current_app, g, jsonify, request
from werkzeug.exceptions import RequestEntityTooLarge

from app.access_log import RequestRecord, current_record
from app.client_watch import ClientConnection
from app import lifecycle
from app.engine.errors import EngineError
from app.json_body import dumps
from app.errors import (
    APIError,
    ClientClosedError,
    InternalServerError,
    InvalidRequestError,
    ServiceUnavailableError,
    UnsupportedMediaTypeError,
    as_api_error,
)
from app.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, parse_request
from app.responses import ResponsesRequest

log = logging.getLogger("saker.api")

bp = Blueprint("api", __name__)


def _service():
    return current_app.extensions["saker.service"]


def json_body() -> object:
    """The request body as JSON; clear 4xx errors for a wrong content type, a body that is not valid chunked
    encoding, an encoding we do not take, or malformed JSON."""
    mimetype = request.mimetype or ""
    if mimetype and mimetype != "application/json" and not mimetype.endswith("+json"):
        raise UnsupportedMediaTypeError(f"Content-Type must be application/json, not {mimetype}")
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in ("", "identity", "gzip", "x-gzip", "deflate"):
        raise UnsupportedMediaTypeError(
            f"Content-Encoding {encoding} is not supported; send the body plain (identity), gzip or deflate"
        )
    try:
        raw = request.get_data(cache=False)
    except Exception as exc:
        if not _is_protocol_error(exc):
            raise
        raise InvalidRequestError(f"the request body is not valid chunked encoding: {exc}") from None
    limit = request.max_content_length
    if limit is not None and request.content_length is None and len(raw) >= limit:
        # A chunked body is read up to the limit and no further; one byte more means it is too large.
        if request.environ["wsgi.input"].read(1):
            raise RequestEntityTooLarge()
    if encoding not in ("", "identity"):
        raw = _decoded(raw, encoding, limit)
    if not raw.strip():
        raise InvalidRequestError("the request body is empty; send a JSON object")
    if nesting_depth(raw, MAX_NESTING) > MAX_NESTING:
        raise InvalidRequestError(
            f"the request body is nested too deeply to be a request (more than {MAX_NESTING} levels of arrays and "
            "objects)"
        )
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None


MAX_NESTING = 128  # levels of arrays and objects a request body may have (tool schemas nest a few dozen at most)
_NESTING_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')  # a whole string (skipped), or a bracket


def nesting_depth(raw: bytes, limit: int) -> int:
    """How deep the arrays and objects of a JSON text nest, counted without recursing (so the answer does not
    depend on how deep the caller's stack already is), up to the first level past ``limit``. Brackets inside
    strings do not count; a text that is not JSON gets some number and fails in the parser."""
    depth = deepest = 0
    for match in _NESTING_TOKENS.finditer(raw):
        first = match.group()[0]
        if first in b"[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if depth > limit:
                    break
        elif first in b"]}":
            depth -= 1
    return deepest


def _is_protocol_error(exc: BaseException) -> bool:
    try:
        from gunicorn.http.errors import ParseException
    except ImportError:  # another WSGI server
        return False
    return isinstance(exc, ParseException)


def _decoded(raw: bytes, encoding: str, limit: int | None) -> bytes:
    """A gzip or deflate body, decompressed; the decoded size counts against the body limit (a small bomb
    cannot expand past it)."""
    import zlib

    wbits = zlib.MAX_WBITS | 16 if "gzip" in encoding else zlib.MAX_WBITS
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(raw, (limit + 1) if limit else 0)
        if limit and len(out) > limit:
            raise RequestEntityTooLarge()
        if not inflater.eof:
            raise InvalidRequestError(f"the request body is a truncated {encoding} stream")
    except zlib.error as exc:
        raise InvalidRequestError(f"the request body is not valid {encoding}: {exc}") from None
    return out


def _reject_constant(name: str):
    """NaN and Infinity are not JSON (RFC 8259); Python's parser would take them and pass range checks."""
    raise ValueError(f"{name} is not a valid JSON number")


@bp.get("/health")
def health():
    _service().worker.require_ready()
    return jsonify({"status": "ok"})


@bp.get("/livez")
def livez():
    """Liveness: 200 while the process serves (loading, ready or draining); 503 when its engine has made no step
    for SAKER_LIVENESS_TIMEOUT seconds while requests are in it, or has stopped (the worker needs replacing)."""
    limit = current_app.extensions["saker.settings"].liveness_timeout
    stalled = _service().worker.stalled_s()
    if limit and stalled > limit:
        what = "stopped" if stalled == float("inf") else f"made no step for {stalled:.0f} s while requests wait"
        raise ServiceUnavailableError(
            f"the engine has {what} (SAKER_LIVENESS_TIMEOUT={limit:g}): this worker needs a restart",
            code="engine_stalled",
        )
    return jsonify({"status": "alive"})


@bp.get("/readyz")
def readyz():
    """Readiness: 200 once the model is loaded, 503 while it loads or after a stop was asked for (draining)."""
    if lifecycle.draining.is_set():
        raise ServiceUnavailableError(
            "this replica is stopping: send requests to another one", code="draining", headers={"Retry-After": "1"}
        )
    _service().worker.require_ready()
    return jsonify({"status": "ready"})


@bp.get("/v1/models")
def list_models():
    return jsonify(_service().list_models())


@bp.get("/v1/models/<path:model_id>")
def get_model(model_id: str):
    return jsonify(_service().get_model(model_id))


@bp.post("/v1/completions")
def completions():
    return _answer(parse_request(CompletionRequest, json_body()))


@bp.post("/v1/chat/completions")
def chat_completions():
    return _answer(parse_request(ChatCompletionRequest, json_body()))


@bp.post("/tokenize")
def tokenize():
    return jsonify(_service().tokenize(parse_request(TokenizeRequest, json_body())))


@bp.post("/detokenize")
def detokenize():
    return jsonify(_service().detokenize(parse_request(DetokenizeRequest, json_body())))


@bp.get("/tokenizer_info")
def tokenizer_info():
    return jsonify(_service().tokenizer_info())


def _answer(body):
    service = _service()
    record = current_record() or RequestRecord("", "", "")
    record.request_body(body)
    if body.stream:
        return _event_stream(service, service.prepare(body), record)
    try:
        served = service.complete(body, alive=_client_alive(request.environ))
    except ClientClosedError as exc:
        timings = getattr(exc, "timings", None)
        if timings is not None:
            record.timings(timings)
            log.info(
                "request %s ended early after %d generated tokens: its client closed the connection",
                g.request_id,
                timings.generated_tokens,
            )
        raise
    record.answered(served.body, served.timings)
    response = jsonify(served.body)
    t = served.timings
    response.headers["X-Saker-Queue-Ms"] = f"{t.queue_s * 1000:.3f}"
    response.headers["X-Saker-Prefill-Ms"] = f"{t.prefill_s * 1000:.3f}"
    response.headers["X-Saker-Decode-Ms"] = f"{t.decode_s * 1000:.3f}"
    response.headers["X-Saker-Tokens-Per-Second"] = f"{t.tokens_per_second:.3f}"
    response.headers["X-Saker-Cached-Prompt-Tokens"] = str(t.cached_tokens)
    return response


def _client_alive(environ):
    """A check that the client of a plain request is still connected (gunicorn hands the socket over): readable
    with nothing to read means it closed. None where there is no socket (the test client)."""
    sock = environ.get("gunicorn.socket")
    return None if sock is None else ClientConnection(sock)


def _event_stream(service, job, record: RequestRecord) -> Response:
    """``data: {chunk}`` frames as tokens become final, then ``data: [DONE]``."""
    return _server_sent(service.stream(job, alive=_client_alive(request.environ)), job, record, _data_frame, done=True)


def _data_frame(chunk: dict) -> str:
    return f"data: {dumps(chunk)}\n\n"


def _typed_frame(event: dict) -> str:
    """A Responses event: its type as the SSE event name."""
    return f"event: {event['type']}\ndata: {dumps(event)}\n\n"


def _server_sent(chunks, job, record: RequestRecord, frame, done: bool, headers: dict | None = None) -> Response:
    """A stream of frames. An error after the first byte is sent as a ``data: {"error": ...}`` frame. A client
    that goes away closes this generator: the worker stops at the current step and takes the next request."""
    request_id = g.request_id
    # The first chunk is awaited here, before the 200 goes out: a full queue (429), a queue timeout or an
    # error before the first token (503 out of memory, ...) is an HTTP error the client can act on.
    try:
        first = next(chunks, None)
    except BaseException:
        chunks.close()
        raise
    record.stream_started(job.model)

    def frames():
        finished = False
        try:
            for chunk in itertools.chain([first] if first is not None else [], chunks):
                record.stream_chunk(chunk)
                if chunk.get("type") == "response.failed":  # a Responses stream's own error event
                    record.error_code = (chunk["response"].get("error") or {}).get("code")
                yield frame(chunk)
            finished = True
        except (APIError, EngineError) as exc:
            err = as_api_error(exc, request_id)
            record.error_code = err.code or err.type
            yield _data_frame(err.body())
        except Exception:
            log.exception("stream %s failed", request_id)
            record.error_code = InternalServerError.code
            err = InternalServerError(f"The server had an error while streaming (request id {request_id})")
            yield _data_frame(err.body())
        finally:
            chunks.close()  # a dropped client lands here: the worker is freed at once
            record.stream_ended(job.prompts, job.timings)
            if not finished:
                log.info("stream %s ended early after %d generated tokens", request_id, job.timings.generated_tokens)
        if done:
            yield "data: [DONE]\n\n"
        record.finish()

    return Response(
        frames(),
        mimetype="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
    )


# -- the Responses API ----------------------------------------------------------------------------------------
def _responses():
    return current_app.extensions["saker.responses"]


def _ignored_tools(ignored: list[str]) -> dict:
    """Tool types a local server cannot run were left out of the prompt: named here."""
    return {"X-Saker-Ignored-Tools": ", ".join(dict.fromkeys(ignored))} if ignored else {}


@bp.post("/v1/responses")
def create_response():
    body = json_body()
    req = parse_request(ResponsesRequest, body)
    service = _responses()
    record = current_record() or RequestRecord("", "", "")
    record.model = req.model
    if req.stream:
        state, ignored = service.prepare_stream(req, body)
        return _server_sent(
            service.events(state, alive=_client_alive(request.environ)),
            state.prepared,
            record,
            _typed_frame,
            done=False,
            headers=_ignored_tools(ignored),
        )
    response, timings, ignored = service.create(req, body, alive=_client_alive(request.environ))
    record.timings(timings)
    record.model = response["model"]
    record.prompt_tokens = response["usage"]["input_tokens"]
    record.completion_tokens = response["usage"]["output_tokens"]
    answer = jsonify(response)
    answer.headers.update(_ignored_tools(ignored))
    return answer


@bp.get("/v1/responses/<response_id>")
def get_response(response_id: str):
    return jsonify(_responses().get(response_id))


@bp.delete("/v1/responses/<response_id>")
def delete_response(response_id: str):
    return jsonify(_responses().delete(response_id))
