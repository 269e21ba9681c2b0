"""What completion and chat answers share: token usage, the timing extension, and extensions that are left out
of an answer unless they were asked for."""

from __future__ import annotations

from pydantic import BaseModel


def drop_unasked(data: dict, *keys: str) -> dict:
    """Extensions answered only when asked for: left out of the answer when null."""
    for key in keys:
        if data.get(key) is None:
            data.pop(key, None)
    return data


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
    speculative_draft_tokens: int = 0  # tokens guessed for it (SAKER_SPECULATIVE)
    speculative_accepted_tokens: int = 0  # of which it kept
