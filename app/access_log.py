"""Structured access log: one line per request, written when the request is done (for a stream: when its
last frame is sent or the client goes away), through the ``saker.access`` logger (``app/log_config.py``): on
stderr in the one log format (``SAKER_LOG_FORMAT``), in a file as JSON lines.

Each line holds the request id, method, route, path, status, client address (after ProxyFix), timings
(total, queue wait, prefill, decode, time to first token), token counts and the error code when known. Prompts
and outputs are written only with ``SAKER_LOG_PROMPTS``; headers (and so API keys) never are.

The same ``RequestRecord`` feeds the Prometheus metrics (``app/metrics.py``), so the log and the metrics agree.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

from flask import Flask, g, request

from app.log_config import route_access_log


@dataclass
class RequestRecord:
    request_id: str
    method: str
    path: str
    start: float = field(default_factory=time.perf_counter)
    started_at: float = field(default_factory=time.time)
    route: str = "unmatched"
    status: int | None = None
    client: str | None = None
    model: str | None = None
    stream: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    ttft_s: float | None = None
    error_code: str | None = None
    prompt: Any = None
    output: Any = None
    duration_s: float | None = None
    keep_text: bool = False  # SAKER_LOG_PROMPTS: fill prompt and output
    _done: bool = False
    _on_finish: list[Callable[["RequestRecord"], None]] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def timings(self, timings) -> None:
        """Copy an engine ``Timings`` (queue, prefill, decode, generated tokens)."""
        self.queue_s, self.prefill_s, self.decode_s = timings.queue_s, timings.prefill_s, timings.decode_s
        self.completion_tokens = timings.generated_tokens

    # -- what the API layer tells the record ---------------------------------------------------------------
    def request_body(self, body) -> None:
        """A parsed completion/chat request: the model asked for, and the prompt when prompts are logged."""
        self.model = getattr(body, "model_name", None)
        if self.keep_text:
            prompt = getattr(body, "prompt", None)
            if prompt is None and getattr(body, "messages", None) is not None:
                prompt = [m.model_dump(exclude_none=True) for m in body.messages]
            self.prompt = prompt

    def answered(self, response: dict, timings) -> None:
        """A whole (non-streamed) answer: usage, timings, and the outputs when prompts are logged."""
        self.timings(timings)
        self.model = response.get("model", self.model)
        usage = response.get("usage") or {}
        self.prompt_tokens = usage.get("prompt_tokens")
        self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
        self.ttft_s = timings.queue_s + timings.prefill_s
        if self.keep_text:
            self.output = [c.get("text", (c.get("message") or {}).get("content")) for c in response.get("choices", [])]

    def stream_started(self, model: str | None) -> None:
        self.stream = True
        self.model = model or self.model
        self.ttft_s = time.perf_counter() - self.start

    def stream_chunk(self, chunk: dict) -> None:
        if not self.keep_text:
            return
        if not isinstance(self.output, dict):
            self.output = {}
        for choice in chunk.get("choices") or []:
            text = choice.get("text")
            if text is None:
                text = (choice.get("delta") or {}).get("content")
            if text:
                key = str(choice.get("index", 0))
                self.output[key] = self.output.get(key, "") + text

    def stream_ended(self, prompts: list[list[int]], timings) -> None:
        self.prompt_tokens = sum(len(ids) for ids in prompts)
        self.timings(timings)
        if self.keep_text and isinstance(self.output, dict):
            self.output = [self.output[k] for k in sorted(self.output, key=int)]

    def finish(self) -> None:
        """Log and count the request once (later calls do nothing)."""
        with self._lock:
            if self._done:
                return
            self._done = True
        self.duration_s = time.perf_counter() - self.start
        for callback in self._on_finish:
            callback(self)

    def as_dict(self, with_text: bool) -> dict:
        def ms(value: float | None) -> float | None:
            return None if value is None else round(value * 1000, 3)

        entry = {
            "started_at": datetime.fromtimestamp(self.started_at, timezone.utc).isoformat(timespec="milliseconds"),
            "request_id": self.request_id,
            "method": self.method,
            "route": self.route,
            "path": self.path,
            "status": self.status,
            "client": self.client,
            "duration_ms": ms(self.duration_s),
            "model": self.model,
            "stream": self.stream,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "queue_ms": ms(self.queue_s),
            "prefill_ms": ms(self.prefill_s),
            "decode_ms": ms(self.decode_s),
            "ttft_ms": ms(self.ttft_s),
            "error_code": self.error_code,
        }
        if with_text:
            entry["prompt"] = self.prompt
            entry["output"] = self.output
        return entry


def current_record() -> RequestRecord | None:
    """This request's record (None outside a request, or before the hooks ran)."""
    return g.get("access")


class AccessLog:
    """Logs a record per request on ``saker.access``: ``"-"`` = stderr with the other log lines, ``"off"`` =
    nowhere, else appended to that file (JSON lines). The logger's handlers are set by the logging configuration
    (``app/log_config.py``) and made to match ``destination`` here; one access log per process (the last one
    built decides where the lines go)."""

    def __init__(self, destination: str = "-", log_prompts: bool = False):
        self.destination = destination
        self.log_prompts = log_prompts
        self._logger = route_access_log(destination)

    def write(self, record: RequestRecord) -> None:
        if self.destination == "off":
            return
        self._logger.info(
            "%s %s %s", record.method, record.path, record.status, extra={"fields": record.as_dict(self.log_prompts)}
        )


def install_access_log(app: Flask, access_log: AccessLog, on_finish: list[Callable[[RequestRecord], None]]) -> None:
    """Hooks: a record per request (after the request id is set), status/route/client at the response, and
    ``finish`` (log line + metrics) at once for plain responses, at the end of the body for streamed ones."""
    callbacks = [*on_finish, access_log.write]

    @app.before_request
    def _start_record():
        g.access = RequestRecord(
            request_id=g.get("request_id", ""),
            method=request.method,
            path=request.path,
            keep_text=access_log.log_prompts,
            _on_finish=callbacks,
        )

    @app.after_request
    def _response_record(response):
        record = current_record()
        if record is None:
            return response
        record.status = response.status_code
        record.route = request.url_rule.rule if request.url_rule is not None else "unmatched"
        record.client = request.remote_addr
        if response.is_streamed:
            # finished by the stream itself, or when the server closes the response (client gone, never read)
            response.call_on_close(record.finish)
        else:
            if response.status_code >= 400 and record.error_code is None and response.is_json:
                error = (response.get_json(silent=True) or {}).get("error")
                if isinstance(error, dict):
                    record.error_code = error.get("code") or error.get("type")
            record.finish()
        return response
