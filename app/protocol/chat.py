"""``POST /v1/chat/completions``: messages, tools and ``tool_choice``, how messages are rendered
(``TemplateFields``, shared with ``/tokenize``), the request (``ChatCompletionRequest``) and the answer's
schemas."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_serializer, model_validator

from app.engine.params import SamplingParams
from app.errors import InvalidRequestError
from app.protocol.answers import Timing, Usage, drop_unasked
from app.protocol.sampling import Limits, SamplingRequest


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
        # a forced call with response_format or structured_outputs: this turn's answer is the call, whose arguments
        # follow its function's schema; the format is for a final message, which a forced turn does not have (a
        # later turn with tool_choice auto or none answers in it), as OpenAI takes the pair

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


# -- the answer -------------------------------------------------------------------------------------------
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
        return drop_unasked(handler(self), "prompt_logprobs")
