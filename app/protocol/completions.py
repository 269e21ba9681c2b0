"""``POST /v1/completions``: the request (``CompletionRequest``) and the answer's schemas."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_serializer,
    model_validator,
)

from app.engine.params import SamplingParams
from app.errors import InvalidRequestError
from app.protocol.answers import Timing, Usage, drop_unasked
from app.protocol.sampling import Limits, SamplingRequest

TokenIds = Annotated[list[StrictInt], Field(min_length=1)]
Prompt = Union[StrictStr, list[StrictStr], list[StrictInt], list[TokenIds]]


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. Unknown fields are ignored; ``engine`` is an old alias of ``model``."""

    engine: StrictStr | None = None
    prompt: Prompt
    suffix: StrictStr | None = None
    logprobs: StrictInt | None = Field(None, ge=0)
    echo: StrictBool | None = False
    best_of: StrictInt | None = Field(None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be an empty list")
        return value

    @model_validator(mode="after")
    def _cross_field(self) -> "CompletionRequest":
        if self.suffix:
            raise InvalidRequestError("suffix is not supported by this model server", param="suffix")
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidRequestError(
                f"best_of ({self.best_of}) must be greater than or equal to n ({self.n})", param="best_of"
            )
        self._check_common()
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise InvalidRequestError(
                "best_of > n cannot be streamed: the best candidates are known only at the end; send stream: false",
                param="best_of",
            )
        return self

    @property
    def model_name(self) -> str | None:
        return self.model if self.model is not None else self.engine

    def prompt_list(self) -> list[str | list[int]]:
        """The prompt as a list of prompts, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def to_sampling_params(self, limits: Limits, *, vocab_size: int, adapter: str | None = None) -> SamplingParams:
        return self._sampling_params(
            limits,
            vocab_size,
            adapter,
            logprobs=self.logprobs,
            logprobs_param="logprobs",
            echo=bool(self.echo),
            best_of=self.best_of,
        )


# -- the answer -------------------------------------------------------------------------------------------
class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's, when asked for

    @model_serializer(mode="wrap")
    def _without_unasked(self, handler):
        return drop_unasked(handler(self), "prompt_logprobs")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None
    timing: Timing | None = None
