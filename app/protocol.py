"""Request and response schemas (OpenAI's shapes); requests convert themselves into engine parameters.

Validation errors become ``InvalidRequestError`` with ``param`` naming the field (see ``parse_request``).
Limits that depend on the server's settings are checked in ``to_sampling_params``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from app.engine.params import Constraint, SamplingParams
from app.errors import InvalidRequestError

Number = Annotated[StrictFloat, AllowInfNan(False)]  # ints are taken; NaN and +-inf are not
TokenIds = Annotated[list[StrictInt], Field(min_length=1)]
Prompt = Union[StrictStr, list[StrictStr], list[StrictInt], list[TokenIds]]
_TOKEN_ID_KEY = re.compile(r"-?[0-9]+")
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# An explicit null means the default for these fields (OpenAI documents them as nullable). Not for
# max_tokens (null = up to the context) nor prompt (required).
_NULL_IS_DEFAULT = frozenset({"n", "min_tokens", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens"})
# Below this a temperature is greedy (as in vLLM): dividing float32 logits by a tinier one overflows to inf.
GREEDY_BELOW_TEMPERATURE = 1e-5
# repetition_penalty divides (or multiplies) logits; outside this range float32 logits overflow to +-inf.
REPETITION_PENALTY_RANGE = (0.01, 100.0)


def _check_schema(schema: Any, where: str) -> None:
    """A JSON schema is an object (llguidance says later whether it can compile it)."""
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON schema object, not {type(schema).__name__}")


def json_constraint(schema: dict) -> Constraint:
    """A JSON schema as a constraint (its JSON text: equal schemas share a compiled grammar). Keys keep their
    order: properties are generated in the order the schema lists them."""
    return Constraint("json_schema", json.dumps(schema, ensure_ascii=False))


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
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in _NULL_IS_DEFAULT):
            data = {k: v for k, v in data.items() if not (v is None and k in _NULL_IS_DEFAULT)}
        if isinstance(data, dict) and any(data.get(k) is not None for k in _GUIDED):
            # vLLM's names before 0.12 (guided_json, ...), still sent by many clients: the same as
            # structured_outputs, so that a request for JSON never gets free text
            given = {_GUIDED[k]: data[k] for k in _GUIDED if data.get(k) is not None}
            if data.get("structured_outputs") is not None:
                raise InvalidRequestError(
                    "send structured_outputs or the older guided_* fields, not both", param="structured_outputs"
                )
            data = {**data, "structured_outputs": given}
        return data

    @field_validator("logit_bias")
    @classmethod
    def _bias_values(cls, value):
        for key, bias in (value or {}).items():
            if not _TOKEN_ID_KEY.fullmatch(key):  # str.isdigit() takes "²", which int() refuses
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if len(key.lstrip("-")) > 12:  # no vocabulary is that large (and int() refuses 4300+ digits)
                raise ValueError(f"logit_bias keys must be token ids, got a {len(key)}-digit number")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be within [-100, 100], got {bias} for {key}")
        return value

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value):
        """OpenAI's shapes: ``text``, ``json_object``, ``json_schema`` with ``json_schema: {name, description,
        schema, strict}``; also llama.cpp's ``schema`` next to ``type`` (json_object or json_schema)."""
        if value is None:
            return value
        kind = value.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"response_format type must be one of text, json_object, json_schema, not {kind!r}")
        if kind == "json_schema":
            spec = value.get("json_schema", {"schema": value["schema"]} if "schema" in value else None)
            if not isinstance(spec, dict):
                raise ValueError("response_format json_schema needs a json_schema object: {name, schema, strict}")
            name = spec.get("name")
            if name is not None and not (isinstance(name, str) and _SCHEMA_NAME.fullmatch(name)):
                raise ValueError("response_format json_schema.name must be 1-64 letters, digits, _ or -")
            _check_schema(spec.get("schema", {}), "response_format json_schema.schema")
        elif kind == "json_object" and "schema" in value:
            _check_schema(value["schema"], "response_format schema")
        return value

    @field_validator("structured_outputs")
    @classmethod
    def _structured_outputs(cls, value):
        """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar, json_object."""
        if value is None:
            return value
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if value.get(k) not in (None, False)]
        if "structural_tag" in value:
            raise ValueError("structured_outputs structural_tag is not supported; use json, regex, choice or grammar")
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, regex, choice, grammar, json_object"
                + (f"; got {', '.join(given)}" if given else "")
            )
        kind, spec = given[0], value[given[0]]
        if kind == "json":
            if isinstance(spec, str):
                try:
                    spec = json.loads(spec)
                except ValueError:
                    raise ValueError(
                        "structured_outputs json must be a JSON schema (an object, or its JSON text)"
                    ) from None
            _check_schema(spec, "structured_outputs json")
        elif kind in ("regex", "grammar"):
            if not isinstance(spec, str) or not spec:
                raise ValueError(f"structured_outputs {kind} must be a non-empty string")
        elif kind == "choice":
            if not (isinstance(spec, list) and spec and all(isinstance(c, str) and c for c in spec)):
                raise ValueError("structured_outputs choice must be a non-empty list of non-empty strings")
        elif spec is not True:
            raise ValueError("structured_outputs json_object must be true")
        return {kind: spec}

    def constraint(self) -> tuple[Constraint | None, str | None]:
        """What the output must match (``response_format`` or ``structured_outputs``) and the field that asked."""
        fmt, outputs = self.response_format, self.structured_outputs
        if fmt is not None and fmt.get("type") != "text" and outputs is not None:
            raise InvalidRequestError(
                "send either response_format or structured_outputs, not both", param="structured_outputs"
            )
        if outputs is not None:
            ((kind, spec),) = outputs.items()
            if kind == "json":
                return json_constraint(spec), "structured_outputs"
            if kind == "json_object":
                return json_constraint({"type": "object"}), "structured_outputs"
            return Constraint(kind, json.dumps(spec) if kind == "choice" else spec), "structured_outputs"
        if fmt is None or fmt["type"] == "text":
            return None, None
        if fmt["type"] == "json_object":
            return json_constraint(fmt.get("schema", {"type": "object"})), "response_format"
        spec = fmt.get("json_schema", {"schema": fmt.get("schema")})
        return json_constraint(spec.get("schema") or {"type": "object"}), "response_format"

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return value

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
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

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


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    arguments: StrictStr


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: StrictStr | None = None  # which call a tool message answers

    def as_template_message(self) -> dict:
        """What the chat template sees: role and plain-text content (text parts joined); an assistant's tool
        calls with their arguments as objects (as Hugging Face templates read them), a tool answer's call id."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _arguments(text: str):
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
    description: StrictStr | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


_TEMPLATE_OWN = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
        "return_tensors",
        "tokenizer_kwargs",
    }
)


class TemplateFields(BaseModel):
    """How chat messages are rendered (chat and /tokenize alike; vLLM's names)."""

    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False  # the last (assistant) message is left open and continued
    chat_template_kwargs: dict[StrictStr, Any] | None = None  # more variables for the template (enable_thinking)
    documents: list[dict[StrictStr, Any]] | None = None  # for retrieval templates

    def _check_template_fields(self, messages) -> None:
        if self.continue_final_message:
            if "add_generation_prompt" not in self.model_fields_set:
                self.add_generation_prompt = False
            elif self.add_generation_prompt:
                raise InvalidRequestError(
                    "continue_final_message and add_generation_prompt cannot both be true",
                    param="continue_final_message",
                )
            if not messages or messages[-1].role != "assistant":
                raise InvalidRequestError(
                    "continue_final_message needs an assistant message last", param="continue_final_message"
                )
        taken = sorted(set(self.chat_template_kwargs or {}) & _TEMPLATE_OWN)
        if taken:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {', '.join(taken)} (they are request fields of their own)",
                param="chat_template_kwargs",
            )

    def template_options(self) -> dict:
        """Keyword arguments for ``apply_chat_template`` besides the messages and tools."""
        options: dict = dict(self.chat_template_kwargs or {})
        if self.continue_final_message:
            options["continue_final_message"] = True
        if self.documents is not None:
            options["documents"] = self.documents
        return options


class ChatCompletionRequest(TemplateFields, SamplingRequest):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: StrictInt | None = Field(None, ge=0)
    max_completion_tokens: StrictInt | None = Field(None, ge=0)
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = Field(None, ge=0)
    echo: StrictBool = False  # vLLM's: the answer starts with the last assistant message
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = True

    @model_validator(mode="after")
    def _cross_field(self) -> "ChatCompletionRequest":
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        self._check_common()
        self._check_tools()
        self._check_template_fields(self.messages)
        return self

    @property
    def echoed(self) -> str | None:
        """With ``echo``: the text the answer starts with (the last message, when it is the assistant's)."""
        if not self.echo or self.messages[-1].role != "assistant":
            return None
        return self.messages[-1].as_template_message()["content"]

    def _check_tools(self) -> None:
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise InvalidRequestError(
                f"tools: function names must be unique; repeated: {', '.join(twice)}", param="tools"
            )
        for tool in self.tools or []:
            if tool.function.parameters is not None and tool.function.parameters.get("type", "object") != "object":
                raise InvalidRequestError(
                    f"tools: the parameters of {tool.function.name} must be a JSON schema of an object", param="tools"
                )
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise InvalidRequestError(
                f"tool_choice names {choice.function.name!r}, which is not among the tools"
                + (f" ({', '.join(names)})" if names else ""),
                param="tool_choice",
            )
        if choice == "required" and not names:
            raise InvalidRequestError("tool_choice required needs tools", param="tool_choice")
        if self.calls_tools and self.constraint()[0] is not None:
            raise InvalidRequestError(
                "tool_choice required or a named function cannot be combined with "
                "response_format or structured_outputs",
                param="tool_choice",
            )

    @property
    def tool_mode(self) -> str:
        """none (tools are left out of the prompt), auto, required or named."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def calls_tools(self) -> bool:
        """Whether the answer must be tool calls (required or a named function: forced by a grammar)."""
        return self.tool_mode in ("required", "named")

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template takes them (OpenAI's shape), unless tool_choice is none."""
        if self.tool_mode == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def template_messages(self) -> list[dict]:
        return [m.as_template_message() for m in self.messages]

    def to_sampling_params(self, limits: Limits, *, vocab_size: int, adapter: str | None = None) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(limits, vocab_size, adapter, logprobs=logprobs, logprobs_param="top_logprobs")


class TokenizeRequest(TemplateFields):
    """POST /tokenize (vLLM's shape): a prompt, or chat messages rendered with the template."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None  # with messages: rendered by the template as chat does
    add_special_tokens: StrictBool | None = None
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("send exactly one of prompt or messages", param="prompt")
        self._check_template_fields(self.messages)
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    tokens: list[StrictInt]


def _lone_surrogate_field(value: Any, field: str | None = None) -> str | None:
    """The top-level field holding a string with a lone UTF-16 surrogate (JSON's ``"\\ud800"``), which is
    not Unicode: tokenizers and UTF-8 encoders fail on it. None when every string is valid."""
    stack = [(field, value)]
    while stack:
        name, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return name or "body"
        elif isinstance(item, dict):
            stack.extend((name or key, v) for key, v in item.items())
            stack.extend((name or key, key) for key in item)
        elif isinstance(item, list):
            stack.extend((name, v) for v in item)
    return None


def parse_request(model_cls: type[BaseModel], body: Any) -> BaseModel:
    """Validate a JSON body; the first problem becomes a 400 naming its field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object", param=None)
    bad = _lone_surrogate_field(body)
    if bad is not None:
        raise InvalidRequestError(
            f"{bad} holds a lone UTF-16 surrogate escape (such as \\ud800), which is not valid Unicode",
            param=None if bad == "body" else bad,
        )
    try:
        return model_cls.model_validate(_integral_numbers(body))
    except ValidationError as exc:
        raise _as_invalid_request(exc) from None


def _integral_numbers(value):
    """JSON has one number type: ``1.0`` is the integer 1 (JSON Schema says so, and some clients write integers
    so). Whole floats become ints before validation (float fields take ints as they are; ``1.5`` stays)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, dict):
        return {key: _integral_numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_integral_numbers(item) for item in value]
    return value


def _as_invalid_request(exc: ValidationError) -> InvalidRequestError:
    errors = exc.errors()
    first = errors[0]
    ctx_error = (first.get("ctx") or {}).get("error")
    if isinstance(ctx_error, InvalidRequestError):
        return ctx_error
    loc = [str(x) for x in first["loc"] if not isinstance(x, int)]
    # union members show up as extra loc parts ("str", "list[int]"); keep the field name only
    param = loc[0] if loc else None
    fields = {e["loc"][0] for e in errors if e["loc"]}
    if first["type"] == "missing":
        return InvalidRequestError(f"{param} is required", param=param)
    msg = first["msg"].removeprefix("Value error, ")
    if len(fields) == 1 and len(errors) > 1 and param in ("prompt", "stop", "logit_bias", "stop_token_ids"):
        msg = (
            {
                "prompt": "prompt must be a string, a list of strings, a list of token ids or a list of "
                "lists of token ids",
                "stop": "stop must be a string or a list of strings",
                "logit_bias": "logit_bias must map token ids to numbers",
                "stop_token_ids": "stop_token_ids must be a list of token ids",
            }[param]
            if first["type"] != "value_error"
            else msg
        )
    if param and not msg.startswith(param):
        msg = f"{param}: {msg}"
    return InvalidRequestError(msg, param=param)


# -- responses --------------------------------------------------------------------------------------------
class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


def _drop_unasked(data: dict, *keys: str) -> dict:
    """Extensions answered only when asked for: left out of the answer when null."""
    for key in keys:
        if data.get(key) is None:
            data.pop(key, None)
    return data


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's, when asked for

    @model_serializer(mode="wrap")
    def _without_unasked(self, handler):
        return _drop_unasked(handler(self), "prompt_logprobs")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Timing(BaseModel):
    """saker extension: where the request's time went (also sent as X-Saker-* headers)."""

    queue_ms: float
    prefill_ms: float
    decode_ms: float
    tokens_per_second: float
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache (SAKER_PREFIX_CACHE_TOKENS)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None
    timing: Timing | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "saker"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None  # OpenAI's schema requires it; a local model never refuses


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None  # required by OpenAI's schema; always null here
    tool_calls: list[dict] | None = None  # OpenAI's {id, type: function, function: {name, arguments}}; left out
    # of the message when there are none, as OpenAI does
    reasoning: str | None = None  # a reasoning parser's thoughts (vLLM's current name)
    reasoning_content: str | None = None  # the same, under the older name clients still read

    @model_serializer(mode="wrap")
    def _without_empty_fields(self, handler):
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        for key in ("reasoning", "reasoning_content"):
            if data.get(key) is None and key not in self.model_fields_set:
                data.pop(key, None)
        return data


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    timing: Timing | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's, when asked for

    @model_serializer(mode="wrap")
    def _without_unasked(self, handler):
        return _drop_unasked(handler(self), "prompt_logprobs")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    tokenizer_class: str
    eos_token: str | None = None
    eos_token_id: int | None = None
    bos_token: str | None = None
    bos_token_id: int | None = None
    pad_token: str | None = None
    pad_token_id: int | None = None
    unk_token: str | None = None
    model_max_length: int
    vocab_size: int
    chat_template: str | None = None
    add_bos_token: bool | None = None


class HealthResponse(BaseModel):
    status: Literal["ok", "alive", "ready"] = "ok"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error answer (and a stream's error frame): OpenAI's shape, see app/errors.py."""

    error: ErrorDetail
