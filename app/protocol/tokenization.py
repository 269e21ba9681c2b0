"""``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` (vLLM's shapes): requests and answers."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, model_validator

from app.errors import InvalidRequestError
from app.protocol.chat import ChatMessage, ChatTool, TemplateFields


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
