"""The tokenizer endpoints (vLLM's): ``/tokenize`` (a prompt, or chat messages rendered as chat renders them),
``/detokenize`` and ``/tokenizer_info``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.errors import InvalidRequestError
from app.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse, TokenizerInfo

if TYPE_CHECKING:
    from app.service.completion_service import CompletionService


def tokenize(service: CompletionService, request: TokenizeRequest) -> dict:
    service.resolve_model(request.model)
    tok = service.worker.tokenizer
    if request.messages is not None:
        messages = [m.as_template_message() for m in request.messages]
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
        if request.add_special_tokens:
            text = service.chat_template.apply(
                messages,
                request.add_generation_prompt,
                tokenize=False,
                tools=tools,
                options=request.template_options(),
            )
            ids = list(tok(text, add_special_tokens=True)["input_ids"])
        else:
            ids = service.chat_template.render(
                messages, request.add_generation_prompt, tools, request.template_options()
            )
    else:
        add = True if request.add_special_tokens is None else request.add_special_tokens
        ids = list(tok(request.prompt, add_special_tokens=add)["input_ids"])
    strs = tok.convert_ids_to_tokens(ids) if request.return_token_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=service.max_total_tokens, tokens=ids, token_strs=strs
    ).model_dump()


def detokenize(service: CompletionService, request: DetokenizeRequest) -> dict:
    service.resolve_model(request.model)
    vocab = service.worker.require_ready().vocab_size
    bad = next((t for t in request.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"tokens holds {bad}, outside the vocabulary (0..{vocab - 1})", param="tokens")
    return DetokenizeResponse(prompt=service.worker.tokenizer.decode(request.tokens)).model_dump()


def tokenizer_info(service: CompletionService) -> dict:
    tok = service.worker.tokenizer
    info = service.worker.require_ready()
    return TokenizerInfo(
        tokenizer_class=type(tok).__name__,
        eos_token=tok.eos_token,
        eos_token_id=tok.eos_token_id,
        bos_token=tok.bos_token,
        bos_token_id=tok.bos_token_id,
        pad_token=tok.pad_token,
        pad_token_id=tok.pad_token_id,
        unk_token=tok.unk_token,
        model_max_length=service.max_total_tokens,
        vocab_size=info.vocab_size,
        chat_template=service.chat_template.text(),
        add_bos_token=adds_bos(tok),
    ).model_dump()


def adds_bos(tok) -> bool:
    """Whether encoding a text puts BOS first (what the tokenizer does, not what its config claims)."""
    ids = tok("a")["input_ids"]
    return bool(ids) and tok.bos_token_id is not None and ids[0] == tok.bos_token_id
