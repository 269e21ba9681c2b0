"""The request fields completions and chat share (``SamplingRequest``) and their conversion into the engine's
frozen ``SamplingParams``; limits that depend on the server's settings (``Limits``) are checked there, each
violation naming its field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from app.engine.params import Constraint, SamplingParams
from app.errors import InvalidRequestError
from app.protocol.fields import Number, check_logit_bias, check_stop_strings, nulls_as_defaults
from app.protocol.structured_outputs import (
    check_response_format,
    check_structured_outputs,
    constraint_of,
    guided_as_structured_outputs,
)

# Below this a temperature is greedy (as in vLLM): dividing float32 logits by a tinier one overflows to inf.
GREEDY_BELOW_TEMPERATURE = 1e-5
# repetition_penalty divides (or multiplies) logits; outside this range float32 logits overflow to +-inf.
REPETITION_PENALTY_RANGE = (0.01, 100.0)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False  # vLLM's extension: usage so far on every chunk


@dataclass(frozen=True)
class Limits:
    """The server's request limits (from Settings), as the protocol layer needs them."""

    max_logprobs: int = 20
    max_n: int = 20
    max_best_of: int = 20
    max_stop_sequences: int = 4


class SamplingRequest(BaseModel):
    """Fields that completions and chat share; each request converts itself into SamplingParams."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(16, ge=0)
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, ge=0, le=1)
    n: StrictInt | None = Field(1, ge=1)  # null: the default (here and in the other null-default fields)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    logit_bias: dict[StrictStr, Number] | None = None
    seed: StrictInt | None = Field(None, ge=-(2**63), le=2**63 - 1)
    user: StrictStr | None = None
    # extensions (vLLM names)
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: Number | None = Field(None, ge=0, le=1)
    repetition_penalty: Number | None = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    min_tokens: StrictInt | None = Field(0, ge=0)
    ignore_eos: StrictBool | None = False
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool | None = False
    skip_special_tokens: StrictBool | None = True
    response_format: dict | None = None
    structured_outputs: dict | None = None  # vLLM's: json, regex, choice, grammar, json_object
    allowed_token_ids: list[StrictInt] | None = None
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    prompt_logprobs: StrictInt | None = Field(None, ge=0)  # vLLM's: each prompt token's logprob, rank, top k
    return_tokens_as_token_ids: StrictBool | None = False  # vLLM's: logprob tokens as "token_id:<id>"

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):
        return guided_as_structured_outputs(nulls_as_defaults(data))

    @field_validator("logit_bias")
    @classmethod
    def _bias_values(cls, value):
        return check_logit_bias(value)

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value):
        return check_response_format(value)

    @field_validator("structured_outputs")
    @classmethod
    def _structured_outputs(cls, value):
        return check_structured_outputs(value)

    def constraint(self) -> tuple[Constraint | None, str | None]:
        """What the output must match (``response_format`` or ``structured_outputs``) and the field that asked."""
        return constraint_of(self.response_format, self.structured_outputs)

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        return check_stop_strings(value)

    def _check_common(self) -> None:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})", param="min_tokens"
            )
        if self.top_k == 0:
            self.top_k = None
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")

    @property
    def model_name(self) -> str | None:
        return self.model

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: vLLM's ``continuous_usage_stats``, which counts only with ``include_usage`` (a
        client that asked for no usage gets none)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def _sampling_params(
        self,
        limits: Limits,
        vocab_size: int,
        adapter: str | None,
        *,
        logprobs: int | None,
        logprobs_param: str,
        echo: bool = False,
        best_of: int | None = None,
    ) -> SamplingParams:
        """Request value -> OpenAI default; each limit violation names its field."""
        if self.n > limits.max_n:
            raise InvalidRequestError(f"n must be at most {limits.max_n}, got {self.n}", param="n")
        if best_of is not None and best_of > limits.max_best_of:
            raise InvalidRequestError(f"best_of must be at most {limits.max_best_of}, got {best_of}", param="best_of")
        if logprobs is not None and logprobs > min(limits.max_logprobs, vocab_size):
            raise InvalidRequestError(
                f"{logprobs_param} must be at most {min(limits.max_logprobs, vocab_size)} "
                f"(SAKER_MAX_LOGPROBS={limits.max_logprobs}, vocabulary {vocab_size}), got "
                f"{logprobs}",
                param=logprobs_param,
            )
        if self.prompt_logprobs is not None and self.prompt_logprobs > min(limits.max_logprobs, vocab_size):
            raise InvalidRequestError(
                f"prompt_logprobs must be at most {min(limits.max_logprobs, vocab_size)} "
                f"(SAKER_MAX_LOGPROBS={limits.max_logprobs}, vocabulary {vocab_size}), got "
                f"{self.prompt_logprobs}",
                param="prompt_logprobs",
            )
        if len(self.stop_list) > limits.max_stop_sequences:
            raise InvalidRequestError(
                f"stop may hold at most {limits.max_stop_sequences} sequences, got {len(self.stop_list)}", param="stop"
            )
        bias, outside = [], []
        for key, value in (self.logit_bias or {}).items():
            token = int(key)
            if not 0 <= token < vocab_size:
                outside.append(token)
            bias.append((token, float(value)))
        if outside:
            shown = ", ".join(str(t) for t in outside[:8]) + (
                f" and {len(outside) - 8} more" if len(outside) > 8 else ""
            )
            raise InvalidRequestError(
                f"logit_bias token ids outside the vocabulary (0..{vocab_size - 1}): {shown}", param="logit_bias"
            )
        for token in self.stop_token_ids or []:
            if not 0 <= token < vocab_size:
                raise InvalidRequestError(
                    f"stop_token_ids holds {token}, outside the vocabulary (0..{vocab_size - 1})",
                    param="stop_token_ids",
                )
        if self.allowed_token_ids is not None:
            outside = [t for t in self.allowed_token_ids if not 0 <= t < vocab_size]
            if outside or not self.allowed_token_ids:
                raise InvalidRequestError(
                    "allowed_token_ids must be a non-empty list of ids in the vocabulary "
                    f"(0..{vocab_size - 1})" + (f"; outside: {outside[:8]}" if outside else ""),
                    param="allowed_token_ids",
                )
        constraint, asked_by = self.constraint()
        if constraint is not None and self.allowed_token_ids is not None:
            raise InvalidRequestError(
                f"allowed_token_ids cannot be combined with {asked_by}: the grammar decides which tokens may come",
                param="allowed_token_ids",
            )
        return SamplingParams(
            n=self.n,
            best_of=best_of,
            max_tokens=self.max_tokens,
            temperature=1.0
            if self.temperature is None
            else 0.0
            if self.temperature < GREEDY_BELOW_TEMPERATURE
            else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=min(self.top_k, vocab_size) if self.top_k and self.top_k > 0 else 0,  # more is all of them
            min_p=float(self.min_p or 0.0),
            presence_penalty=float(self.presence_penalty or 0.0),
            frequency_penalty=float(self.frequency_penalty or 0.0),
            repetition_penalty=float(self.repetition_penalty or 1.0),
            logit_bias=tuple(bias),
            seed=self.seed,
            stop=self.stop_list,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            echo=echo,
            skip_special_tokens=self.skip_special_tokens,
            adapter=adapter,
            allowed_token_ids=tuple(sorted(set(self.allowed_token_ids))) if self.allowed_token_ids else None,
            processed_logprobs=self.logprobs_mode == "processed_logprobs",
            constraint=constraint,
            prompt_logprobs=self.prompt_logprobs,
            tokens_as_ids=bool(self.return_tokens_as_token_ids),
        )
