"""A streamed response as Responses events: ``response.output_item.added``, text, reasoning and function-call
argument deltas, the ``*.done`` events, each with its ``sequence_number``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from app.responses.builder import ResponseBuilder
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

    def call(self, call: dict) -> Iterator[dict]:
        yield from self.close_reasoning()
        item = self.builder.add_call(call)
        index = len(self.builder.output) - 1
        arguments = item["arguments"]
        yield self.event(
            "response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"}
        )
        yield self.event(
            "response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=arguments
        )
        yield self.event(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=index,
            name=item["name"],
            arguments=arguments,
        )
        yield self.event("response.output_item.done", output_index=index, item=item)
