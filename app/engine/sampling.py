"""Logits processors composed in order, and the seeded token chooser.

Each processor works on a batch ``(B, V)`` of float32 logits of one request's sequences and is left out
when it would do nothing (``build_processors`` only adds what the parameters ask for). They shape
sampling only: reported logprobs come from the raw logits, before any of this.
"""
from __future__ import annotations

import secrets

import torch

from app.engine.params import SamplingParams

NEG_INF = float("-inf")


class TokenHistory:
    """Per-row counts of generated tokens and a mask of prompt+generated tokens, kept only when needed."""

    def __init__(self, batch: int, vocab: int, prompt_ids: list[int], device, *, counts: bool, seen: bool):
        self.device = device
        self.counts = torch.zeros(batch, vocab, dtype=torch.float32, device=device) if counts else None
        self.seen = None
        if seen:
            self.seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
            if prompt_ids:
                self.seen[:, torch.tensor(prompt_ids, device=device)] = True

    def add(self, tokens: torch.Tensor) -> None:
        col = tokens.view(-1, 1)
        if self.counts is not None:
            self.counts.scatter_add_(1, col, torch.ones_like(col, dtype=torch.float32))
        if self.seen is not None:
            self.seen.scatter_(1, col, True)

    def select(self, rows: torch.Tensor) -> None:
        if self.counts is not None:
            self.counts = self.counts.index_select(0, rows)
        if self.seen is not None:
            self.seen = self.seen.index_select(0, rows)


class LogitBias:
    def __init__(self, bias: tuple[tuple[int, float], ...], vocab: int, device):
        self.ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=device)
        self.values = torch.tensor([b for _, b in bias], dtype=torch.float32, device=device)

    def __call__(self, logits: torch.Tensor, history: TokenHistory, step: int) -> torch.Tensor:
        logits[:, self.ids] += self.values
        return logits


class SuppressTokens:
    """min_tokens: EOS and stop tokens cannot be chosen before ``min_tokens`` tokens are out."""

    def __init__(self, ids: list[int], min_tokens: int, device):
        self.ids = torch.tensor(ids, dtype=torch.long, device=device)
        self.min_tokens = min_tokens

    def __call__(self, logits, history, step):
        if step < self.min_tokens:
            logits[:, self.ids] = NEG_INF
        return logits


class RepetitionPenalty:
    """HF/CTRL style: over prompt and generated tokens, divide positive logits, multiply negative ones."""

    def __init__(self, penalty: float):
        self.penalty = penalty

    def __call__(self, logits, history, step):
        penalized = torch.where(logits > 0, logits / self.penalty, logits * self.penalty)
        return torch.where(history.seen, penalized, logits)


class PresenceFrequencyPenalty:
    """OpenAI style, over generated tokens: logit - count * frequency - (count > 0) * presence."""

    def __init__(self, presence: float, frequency: float):
        self.presence, self.frequency = presence, frequency

    def __call__(self, logits, history, step):
        counts = history.counts
        return logits - counts * self.frequency - (counts > 0).float() * self.presence


class Temperature:
    def __init__(self, temperature: float):
        self.temperature = temperature

    def __call__(self, logits, history, step):
        return logits / self.temperature


class TopK:
    def __init__(self, k: int):
        self.k = k

    def __call__(self, logits, history, step):
        k = min(self.k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[:, -1:]
        return logits.masked_fill(logits < kth, NEG_INF)


class TopP:
    def __init__(self, p: float):
        self.p = p

    def __call__(self, logits, history, step):
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs          # mass of the tokens ranked above each token
        remove = before >= self.p
        remove[:, 0] = False                        # the most likely token always stays
        mask = torch.zeros_like(remove).scatter(-1, order, remove)
        return logits.masked_fill(mask, NEG_INF)


class MinP:
    def __init__(self, p: float):
        self.p = p

    def __call__(self, logits, history, step):
        probs = logits.softmax(-1)
        threshold = probs.max(-1, keepdim=True).values * self.p
        return logits.masked_fill(probs < threshold, NEG_INF)


def build_processors(params: SamplingParams, *, vocab: int, suppress_ids: list[int], device) -> list:
    """The processors these parameters need, in order; empty for plain greedy or plain sampling."""
    procs: list = []
    if params.logit_bias:
        procs.append(LogitBias(params.logit_bias, vocab, device))
    if params.min_tokens > 0 and suppress_ids:
        procs.append(SuppressTokens(suppress_ids, params.min_tokens, device))
    if params.repetition_penalty != 1.0:
        procs.append(RepetitionPenalty(params.repetition_penalty))
    if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        procs.append(PresenceFrequencyPenalty(params.presence_penalty, params.frequency_penalty))
    if not params.greedy:
        if params.temperature != 1.0:
            procs.append(Temperature(params.temperature))
        if params.top_k > 0:
            procs.append(TopK(params.top_k))
        if params.top_p < 1.0:
            procs.append(TopP(params.top_p))
        if params.min_p > 0.0:
            procs.append(MinP(params.min_p))
    return procs


def history_needs(params: SamplingParams) -> tuple[bool, bool]:
    """(counts, seen): what TokenHistory must keep for these parameters."""
    return (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0,
            params.repetition_penalty != 1.0)


def sequence_seed(seed: int | None, index: int) -> int:
    """Seed of candidate ``index``: its own stream, so a sequence's samples do not depend on the others."""
    base = seed if seed is not None else secrets.randbits(63)
    return (base * 1_000_003 + index * 0x9E3779B1) % (2 ** 63)


class TokenChooser:
    """Greedy argmax, or a multinomial draw per row from that row's own seeded generator."""

    def __init__(self, params: SamplingParams, device, num_sequences: int):
        self.greedy = params.greedy
        self.generators: list[torch.Generator] = []
        if not self.greedy:
            for i in range(num_sequences):
                gen = torch.Generator(device=device)
                gen.manual_seed(sequence_seed(params.seed, i))
                self.generators.append(gen)

    def select(self, rows: list[int]) -> None:
        if self.generators:
            self.generators = [self.generators[i] for i in rows]

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.greedy:
            return logits.argmax(-1)
        probs = logits.softmax(-1)
        picks = [torch.multinomial(probs[i], 1, generator=gen) for i, gen in enumerate(self.generators)]
        return torch.cat(picks)
