"""Whole (non-streamed) answers: the engine's outputs -> OpenAI's completion and chat response bodies, and the
shapes both answers and stream chunks share (logprobs, timing)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.engine.params import Timings, TokenLogprobs
from app.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Timing,
    Usage,
)
from app.service.answer_reader import finish_reason, reader_for

if TYPE_CHECKING:
    from app.service.prepared import PreparedRequest


def usage_of(outputs) -> Usage:
    """Usage over every prompt of the request (best_of candidates included)."""
    prompt_tokens = sum(o.prompt_tokens for o in outputs)
    completion_tokens = sum(o.completion_tokens for o in outputs)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def completion_response(prepared: PreparedRequest, outputs, timings: Timings, fingerprint: str) -> CompletionResponse:
    """A text completion's answer: one choice per prompt and candidate returned."""
    n = prepared.params.n
    choices = [
        CompletionChoice(
            text=c.text,
            index=p * n + j,
            logprobs=completion_logprobs(c.logprobs),
            finish_reason=c.finish_reason,
            prompt_logprobs=out.prompt_logprobs,
        )
        for p, out in enumerate(outputs)
        for j, c in enumerate(out.choices)
    ]
    return CompletionResponse(
        id=prepared.id,
        created=prepared.created,
        model=prepared.model,
        choices=choices,
        usage=usage_of(outputs),
        timing=timing_of(timings),
        system_fingerprint=fingerprint,
    )


def chat_response(
    prepared: PreparedRequest, outputs, timings: Timings, fingerprint: str, tool_format
) -> ChatCompletionResponse:
    """A chat completion's answer: one choice per candidate returned, read for tool calls and thoughts."""
    n = prepared.params.n
    chat_choices = [
        chat_choice(prepared, p * n + j, c, tool_format)
        for p, out in enumerate(outputs)
        for j, c in enumerate(out.choices)
    ]
    return ChatCompletionResponse(
        id=prepared.id,
        created=prepared.created,
        model=prepared.model,
        choices=chat_choices,
        usage=usage_of(outputs),
        timing=timing_of(timings),
        system_fingerprint=fingerprint,
        prompt_logprobs=outputs[0].prompt_logprobs,
    )


def chat_choice(prepared: PreparedRequest, index: int, choice, tool_format) -> ChatChoice:
    """One chat choice; with tools, the calls are read out of the text and the rest is the content; with a
    reasoning parser, the thoughts too."""
    message = ChatResponseMessage(content=choice.text)
    reader = reader_for(prepared, tool_format)
    if reader is not None:
        thoughts, content, _ = reader.feed(choice.text, final=True)
        calls = reader.calls
        message = ChatResponseMessage(
            content=content or (None if calls or prepared.tools else content),
            tool_calls=[call.as_openai() for call in calls] or None,
        )
        if prepared.thinks is not None:
            message.reasoning = message.reasoning_content = thoughts or None
    if prepared.echoed:
        message.content = prepared.echoed + (message.content or "")
    return ChatChoice(
        index=index,
        message=message,
        logprobs=chat_logprobs(choice.logprobs, prepared.params.logprobs or 0),
        finish_reason=finish_reason(choice.finish_reason, bool(message.tool_calls)),
    )


def completion_logprobs(lp: TokenLogprobs | None) -> CompletionLogprobs | None:
    if lp is None:
        return None
    return CompletionLogprobs(
        tokens=lp.tokens, token_logprobs=lp.token_logprobs, top_logprobs=lp.top_logprobs, text_offset=lp.text_offset
    )


def key_bytes(key: str) -> list[int]:
    """The bytes of a top_logprobs key: ``bytes:\\xNN..`` keys are raw bytes, others UTF-8 text."""
    if key.startswith("bytes:"):
        hexes = key[len("bytes:") :].split("\\x")[1:]
        try:
            return [int(h[:2], 16) for h in hexes]
        except ValueError:
            pass
    return list(key.encode("utf-8"))


def chat_logprobs(lp: TokenLogprobs | None, top_logprobs: int) -> ChatChoiceLogprobs | None:
    """OpenAI's chat shape: one entry per token with its bytes and its ``top_logprobs`` most likely
    alternatives (the chosen token is listed there only when it is among them)."""
    if lp is None:
        return None
    content = []
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        ranked = sorted((top or {}).items(), key=lambda kv: -kv[1])[:top_logprobs]
        alternatives = [ChatTopLogprob(token=k, logprob=v, bytes=key_bytes(k)) for k, v in ranked]
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=logprob if logprob is not None else 0.0,
                bytes=list(token.encode("utf-8")),
                top_logprobs=alternatives,
            )
        )
    return ChatChoiceLogprobs(content=content)


def timing_of(timings: Timings) -> Timing:
    return Timing(
        queue_ms=round(timings.queue_s * 1000, 3),
        prefill_ms=round(timings.prefill_s * 1000, 3),
        decode_ms=round(timings.decode_s * 1000, 3),
        tokens_per_second=round(timings.tokens_per_second, 3),
        cached_prompt_tokens=timings.cached_tokens,
        speculative_draft_tokens=timings.draft_tokens,
        speculative_accepted_tokens=timings.accepted_tokens,
    )
