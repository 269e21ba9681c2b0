"""What the engine hands out, and what the output side makes of it.

The model thread produces numbers only (``PromptNumbers``, ``TokenNumbers``): token ids, raw logprobs, the top-k
ids and values, and whether a row ended on a token-level rule. The output side (``output.py``, on the thread of
the request that reads them) turns them into text events (``PromptEvent``, ``TokenEvent``): detokenizing, stop
strings, logprob keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.engine.params import TokenLogprobs


@dataclass
class PromptNumbers:
    """After the prefill: the prompt's length and, for echo with logprobs, each prompt token's raw logprob and
    the top k (row ``i`` predicts prompt token ``i + 1``)."""

    prompt_tokens: int
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_values: list[list[float]] | None = None
    ranks: list[int] | None = None  # prompt_logprobs: each token's rank in its distribution (1: the top)


@dataclass
class TokenNumbers:
    """One generated token of candidate ``index``: its raw logprob and top k when asked, and ``ended``: why the
    engine ended the candidate's row with it (``StoppingCriteria.ended_by``: "eos", "stop_token", "complete", for a
    constrained output that is whole, or "length"), None when the row goes on."""

    index: int
    token_id: int
    logprob: float | None
    top_ids: list[int] | None
    top_values: list[float] | None
    ended: str | None = None


@dataclass
class PromptEvent:
    """After the prefill: the prompt's text and, when asked, its token strings and logprobs."""

    prompt_tokens: int
    text: str
    logprobs: TokenLogprobs | None
    prompt_logprobs: list | None = None  # vLLM's shape: None, then {token_id: {logprob, rank, decoded_token}}


@dataclass
class TokenEvent:
    """One generated token of candidate ``index``."""

    index: int
    token_id: int
    text: str  # text this token completes (held-back characters excluded)
    logprob: float | None
    top_logprobs: dict[str, float] | None
    finish_reason: str | None = None  # set on the candidate's last token
    text_end: int | None = None  # where the candidate's text is cut (stop strings / tokens)
