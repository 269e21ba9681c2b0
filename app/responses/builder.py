"""The response object of the Responses API: its output items (messages, reasoning, function calls) as they come,
then its status and usage, or its error."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from app.errors import APIError
from app.responses.request import ResponsesRequest


def _echoed_tool(tool: Any) -> Any:
    """A tool as the response echoes it: function tools with ``strict`` and ``parameters`` (null when not sent)."""
    if isinstance(tool, dict) and tool.get("type") == "function":
        return {"strict": None, "parameters": None, **tool}
    return tool


def call_status(item: dict, finish_reason: str | None) -> str:
    """A function_call item's status once the answer is done: ``incomplete`` when the answer was cut
    (max_output_tokens) inside the call, so that its arguments never became whole JSON."""
    if finish_reason == "length":
        try:
            json.loads(item["arguments"])
        except ValueError:
            return "incomplete"
    return "completed"


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


class ResponseBuilder:
    """The response object: its output items as they come, then its status and usage."""

    def __init__(self, request: ResponsesRequest, model: str):
        self.request, self.model = request, model
        self.id = new_id("resp_")
        self.created = int(time.time())
        self.output: list[dict] = []

    def add_message(self, text: str, logprobs: list | None) -> dict:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
        item = {"type": "message", "id": new_id("msg_"), "status": "completed", "role": "assistant", "content": [part]}
        self.output.append(item)
        return item

    def add_reasoning(self, text: str) -> dict:
        item = {
            "type": "reasoning",
            "id": new_id("rs_"),
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed",
        }
        self.output.append(item)
        return item

    def add_call(self, call: dict) -> dict:
        item = {
            "type": "function_call",
            "id": new_id("fc_"),
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"],
            "status": "completed",
        }
        self.output.append(item)
        return item

    def snapshot(self, status: str, output: list | None = None) -> dict:
        r = self.request
        fmt = (r.text or {}).get("format") or {"type": "text"}
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "model": self.model,
            "output": self.output if output is None else output,
            "parallel_tool_calls": r.parallel_tool_calls if r.parallel_tool_calls is not None else True,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": r.store is not False,
            "temperature": r.temperature if r.temperature is not None else 1.0,
            "text": {"format": fmt},
            "tool_choice": r.tool_choice or "auto",
            "tools": [_echoed_tool(t) for t in r.tools or []],
            "top_logprobs": r.top_logprobs or 0,
            "top_p": r.top_p if r.top_p is not None else 1.0,
            "truncation": "disabled",
            "metadata": r.metadata or {},
        }
        if getattr(r, "user", None) is not None:  # left out when unset (the schema has a string or nothing)
            out["user"] = r.user
        return out

    def finish(
        self, finish_reason: str | None, input_tokens: int, output_tokens: int, cached: int, reasoning_tokens: int = 0
    ) -> dict:
        response = self.snapshot("incomplete" if finish_reason == "length" else "completed")
        if finish_reason == "length":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
            for item in response["output"]:
                if item["type"] in ("message", "reasoning"):
                    item["status"] = "incomplete"
                elif item["type"] == "function_call":
                    item["status"] = call_status(item, finish_reason)
        response["usage"] = {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens,
        }
        return response

    def failed(self, err: APIError) -> dict:
        response = self.snapshot("failed")
        code = (
            "rate_limit_exceeded" if err.status == 429 else "invalid_prompt" if err.status == 400 else "server_error"
        )  # the codes the Responses schema has
        response["error"] = {"code": code, "message": err.message}
        return response
