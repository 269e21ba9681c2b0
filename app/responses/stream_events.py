"""A streamed response as Responses events: ``response.output_item.added``, text, reasoning and function-call
argument deltas, the ``*.done`` events, each with its ``sequence_number``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from app.responses.builder import ResponseBuilder, call_status
from app.responses.request import ResponsesRequest

if TYPE_CHECKING:
    from app.service import PreparedRequest


class StreamState:
    """A streamed response's progress: sequence numbers, the open message item, output indexes."""

    def __init__(self, request: ResponsesRequest, prepared: PreparedRequest, conversation: list[dict]):
        self.request, self.prepared, self.conversation = request, prepared, conversation
        self.builder = ResponseBuilder(request, prepared.model)
        self.sequence = 0
        self.message: dict | None = None  # the message item being written
        self.reasoning: dict | None = None  # the reasoning item (a reasoning parser's thoughts)
        self.call: dict | None = None  # the function_call item whose arguments are being written
        self.finish: str | None = None  # the answer's finish_reason, once known
        self.logprobs: list = []

    @property
    def message_open(self) -> bool:
        return self.message is not None

    def event(self, kind: str, **fields) -> dict:
        out = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return out

    def thought(self, text: str) -> Iterator[dict]:
        """Thoughts (a reasoning parser): a ``reasoning`` item before the message, its text in deltas."""
        if self.reasoning is None:
            self.reasoning = self.builder.add_reasoning("")
            self.reasoning["status"] = "in_progress"
            index = len(self.builder.output) - 1
            yield self.event("response.output_item.added", output_index=index, item={**self.reasoning, "content": []})
        self.reasoning["content"][0]["text"] += text
        yield self.event(
            "response.reasoning_text.delta",
            item_id=self.reasoning["id"],
            output_index=self.builder.output.index(self.reasoning),
            content_index=0,
            delta=text,
        )

    def close_reasoning(self) -> Iterator[dict]:
        if self.reasoning is None or self.reasoning["status"] == "completed":
            return
        item = self.reasoning
        index = self.builder.output.index(item)
        yield self.event(
            "response.reasoning_text.done",
            item_id=item["id"],
            output_index=index,
            content_index=0,
            text=item["content"][0]["text"],
        )
        item["status"] = "incomplete" if self.finish == "length" else "completed"
        yield self.event("response.output_item.done", output_index=index, item=item)

    def text_delta(self, text: str, logprobs: list) -> Iterator[dict]:
        yield from self.close_reasoning()
        yield from self.close_call()
        if self.message is None:
            self.message = self.builder.add_message("", [] if self.request.wants_logprobs else None)
            self.message["status"] = "in_progress"
            index = len(self.builder.output) - 1
            yield self.event("response.output_item.added", output_index=index, item={**self.message, "content": []})
            yield self.event(
                "response.content_part.added",
                item_id=self.message["id"],
                output_index=index,
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            )
        part = self.message["content"][0]
        part["text"] += text
        if self.request.wants_logprobs:
            part["logprobs"] += logprobs
        if text:
            yield self.event(
                "response.output_text.delta",
                item_id=self.message["id"],
                output_index=self.builder.output.index(self.message),
                content_index=0,
                delta=text,
                logprobs=logprobs if self.request.wants_logprobs else [],
            )

    def close_message(self) -> Iterator[dict]:
        if self.message is None:
            return
        item, self.message = self.message, None
        index = self.builder.output.index(item)
        part = item["content"][0]
        yield self.event(
            "response.output_text.done",
            item_id=item["id"],
            output_index=index,
            content_index=0,
            text=part["text"],
            logprobs=part.get("logprobs") or [],
        )
        yield self.event(
            "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
        )
        item["status"] = "incomplete" if self.finish == "length" else "completed"
        yield self.event("response.output_item.done", output_index=index, item=item)

    def call_delta(self, entry: dict) -> Iterator[dict]:
        """A chat ``tool_calls`` delta entry: a call's first (with its ``id``) adds a ``function_call`` item (what
        was open before it is done first), the later ones are ``response.function_call_arguments.delta``."""
        if entry.get("id"):
            yield from self.close_reasoning()
            yield from self.close_message()
            yield from self.close_call()
            function = entry.get("function") or {}
            item = self.builder.add_call({"id": entry["id"], "function": {"name": function["name"], "arguments": ""}})
            item["status"] = "in_progress"
            self.call = item
            index = len(self.builder.output) - 1
            yield self.event("response.output_item.added", output_index=index, item=dict(item))
        arguments = (entry.get("function") or {}).get("arguments") or ""
        if arguments and self.call is not None:
            self.call["arguments"] += arguments
            yield self.event(
                "response.function_call_arguments.delta",
                item_id=self.call["id"],
                output_index=self.builder.output.index(self.call),
                delta=arguments,
            )

    def close_call(self) -> Iterator[dict]:
        if self.call is None:
            return
        item, self.call = self.call, None
        index = self.builder.output.index(item)
        yield self.event(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=index,
            name=item["name"],
            arguments=item["arguments"],
        )
        item["status"] = call_status(item, self.finish)
        yield self.event("response.output_item.done", output_index=index, item=item)

    @property
    def calls(self) -> list[dict]:
        """The calls of the answer so far, as chat's ``tool_calls`` (what the store keeps)."""
        return [
            {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            for item in self.builder.output
            if item["type"] == "function_call"
        ]
