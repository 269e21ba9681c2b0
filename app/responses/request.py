"""``POST /v1/responses``: the request's schema (``ResponsesRequest``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from app.protocol import Number

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponsesRequest(BaseModel):
    """POST /v1/responses. Unknown fields and fields that do not apply to a local model (``reasoning`` for a model
    without a reasoning parser, ``prompt_cache_key``, ``service_tier``, ``truncation``, ``client_metadata``,
    ``safety_identifier``, ``include`` values other than output logprobs) are ignored."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    input: StrictStr | list[Any]
    instructions: StrictStr | None = None
    tools: list[Any] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    include: list[StrictStr] | None = None
    text: dict | None = None
    stream: StrictBool | None = False
    store: StrictBool | None = True
    previous_response_id: StrictStr | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    truncation: StrictStr | None = None
    reasoning: dict | None = None

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])
