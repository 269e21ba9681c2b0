"""saker: an OpenAI-compatible completion server over Hugging Face transformers models.

``create_app(settings=None, worker=None)`` is the one seam: tests inject settings and a loaded worker.
"""

from __future__ import annotations

import logging
import os
import signal
import re
import uuid

from flask import Flask, g, jsonify, request
from werkzeug.exceptions import HTTPException

from app.engine.errors import EngineError
from app.errors import (
    APIError,
    InternalServerError,
    InvalidRequestError,
    MethodNotAllowedError,
    NotFoundError,
    RequestTooLargeError,
    from_engine,
)
from app.json_body import JSONProvider
from app.settings import Settings, load_settings

log = logging.getLogger("saker")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def _replace_this_worker(reason: str) -> None:
    """The engine cannot go on (every request in it has failed): this process stops as gunicorn's SIGTERM stops it
    (not ready at once, in-flight answers finish), and gunicorn's master starts a fresh worker in its place."""
    log.critical("saker: %s; this worker exits so that a fresh one takes its place", reason)
    os.kill(os.getpid(), signal.SIGTERM)


def create_app(settings: Settings | None = None, worker=None, *, exit_on_load_error: bool = False) -> Flask:
    """Build the Flask app. ``worker``: a ready ``Worker`` (tests); otherwise one is loaded in the background
    from ``settings`` and /health answers 503 until it is ready."""
    from app.api import bp
    from app.engine.core.worker import Worker
    from app.response_store import ResponseStore
    from app.responses import ResponsesService
    from app.service import CompletionService

    settings = settings or load_settings()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_request_bytes
    app.json = JSONProvider(app)

    if worker is None:
        worker = Worker.from_settings(settings)

        def fail(message: str) -> None:
            if exit_on_load_error:
                # gunicorn reads exit code 3 as "worker failed to boot" and stops instead of retrying forever
                os._exit(3)

        worker.load_in_background(on_error=fail)
    if exit_on_load_error and worker.on_fatal is None:
        worker.on_fatal = _replace_this_worker
    app.extensions["saker.settings"] = settings
    app.extensions["saker.service"] = service = CompletionService(settings, worker)
    app.extensions["saker.responses"] = ResponsesService(
        service, ResponseStore(settings.responses_store_items, settings.responses_store_bytes)
    )
    app.register_blueprint(bp)
    if settings.ui:  # the web page at / (app/ui/): no key needed for the page, its API calls carry the user's
        from app.ui import install_ui

        install_ui(app)
    _register_errors(app)

    @app.before_request
    def _request_id():
        given = request.headers.get("X-Request-ID", "")
        g.request_id = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex

    @app.after_request
    def _echo_request_id(response):
        response.headers["X-Request-ID"] = getattr(g, "request_id", "")
        return response

    _install_operations(app, settings, worker)
    return app


def _install_operations(app: Flask, settings: Settings, worker) -> None:
    """Access log and metrics (every request, 401s included), API keys, /metrics, /openapi.json, ProxyFix.
    The before_request hooks run in this order after the request id: record, in-flight count, key check."""
    from werkzeug.middleware.proxy_fix import ProxyFix

    from app.access_log import AccessLog, install_access_log
    from app.auth import install_auth
    from app.metrics import Metrics, install_metrics
    from app.openapi import install_openapi

    metrics = Metrics(
        worker,
        model_name=settings.model_names[0],
        vllm_aliases=settings.vllm_metrics,
        adapters=tuple(name for name in settings.peft_adapters if name),
    )
    access_log = AccessLog(settings.access_log, settings.log_prompts)
    install_access_log(app, access_log, on_finish=[metrics.observe])
    install_metrics(app, metrics)
    install_auth(app, settings)
    install_openapi(app)
    app.extensions["saker.metrics"] = metrics
    app.extensions["saker.access_log"] = access_log
    if settings.cors_origins:
        from flask_cors import CORS

        origins = [o.strip() for o in settings.cors_origins.split(",") if o.strip()]
        # any request header a preflight asks for (the openai JS client sends its x-stainless-* headers)
        CORS(
            app,
            origins="*" if "*" in origins else origins,
            allow_headers="*",
            expose_headers=[
                "X-Request-ID",
                "X-Saker-Queue-Ms",
                "X-Saker-Prefill-Ms",
                "X-Saker-Decode-Ms",
                "X-Saker-Tokens-Per-Second",
                "X-Saker-Cached-Prompt-Tokens",
                "X-Saker-Ignored-Tools",
                "Retry-After",
            ],
            max_age=600,
        )
    if settings.proxy_hops:
        hops = settings.proxy_hops
        app.wsgi_app = ProxyFix(app.wsgi_app, x_for=hops, x_proto=hops, x_host=hops, x_port=hops, x_prefix=hops)


def error_response(err: APIError):
    response = jsonify(err.body())
    response.status_code = err.status
    for key, value in err.headers.items():
        response.headers[key] = value
    return response


def _register_errors(app: Flask) -> None:
    @app.errorhandler(APIError)
    def _api_error(err: APIError):
        return error_response(err)

    @app.errorhandler(EngineError)
    def _engine_error(exc: EngineError):  # a route that asked the engine directly (readiness, the tokenizer)
        return error_response(from_engine(exc))

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        status = exc.code or 500
        if status == 404:
            err: APIError = NotFoundError(f"Unknown route {request.method} {request.path}")
        elif status == 405:
            allowed = ", ".join(sorted(exc.valid_methods or [])) if hasattr(exc, "valid_methods") else ""
            # RFC 9110: a 405 must carry Allow
            err = MethodNotAllowedError(
                f"Method {request.method} is not allowed on {request.path}" + (f"; use {allowed}" if allowed else ""),
                headers={"Allow": allowed} if allowed else None,
            )
        elif status == 413:
            limit = app.config.get("MAX_CONTENT_LENGTH")
            err = RequestTooLargeError(
                f"The request body is larger than the {limit} bytes allowed (SAKER_MAX_REQUEST_BYTES={limit})"
            )
        elif status < 500:
            err = InvalidRequestError(exc.description or exc.name, status=status)
        else:
            err = InternalServerError(f"Internal server error (request id {getattr(g, 'request_id', '?')})")
        return error_response(err)

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        request_id = getattr(g, "request_id", "?")
        log.exception("request %s failed", request_id)
        return error_response(
            InternalServerError(f"The server had an error while processing your request (request id {request_id})")
        )
