"""Frozen generation parameters: what the protocol layer hands the engine (no pydantic here)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Constraint:
    """What a row's output must match (structured outputs), compiled by ``app/engine/sampling/grammar.py``."""

    kind: str  # "json_schema", "regex", "choice" or "grammar"
    source: str  # the schema as JSON text, the regex, the choices as a JSON list, the Lark/GBNF text
    # json_schema: the whitespace allowed between JSON tokens, a regex ("": none beyond json.dumps' separators;
    # None: the default, ``json_schemas.WHITESPACE``)
    whitespace: str | None = None


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    best_of: int | None = None  # candidates sampled per prompt; the n best by mean logprob are kept
    max_tokens: int | None = 16  # None: up to the context
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; k: the chosen token's plus the k most likely
    echo: bool = False
    skip_special_tokens: bool = True
    adapter: str | None = None  # named PEFT adapter, None: the base model
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be chosen (None: any)
    processed_logprobs: bool = False  # report logprobs of the processed distribution, not the raw one
    constraint: Constraint | None = None  # structured outputs: only tokens that keep the output matching it
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob, rank and the top k (None: off)
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprob tokens as "token_id:<id>"

    @property
    def num_candidates(self) -> int:
        return max(self.best_of or self.n, self.n)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Timings:
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    generated_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache
    draft_tokens: int = 0  # speculative decoding: tokens guessed for its rows
    accepted_tokens: int = 0  # of which its rows kept

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens over the model time (prefill + decode): what a client sees, queue aside."""
        busy = self.prefill_s + self.decode_s
        return self.generated_tokens / busy if busy > 0 and self.generated_tokens else 0.0


@dataclass
class TokenLogprobs:
    """Parallel lists in OpenAI's completions shape."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
