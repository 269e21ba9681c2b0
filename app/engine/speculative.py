"""Speculative decoding (``SAKER_SPECULATIVE``): the proposers: guesses of a sequence's next tokens, which one forward
of the target checks (``generate.decode_step``: a row with ``k`` guesses computes ``1 + k`` positions in the step's
flat forward, and keeps the guesses its own sampler would have picked).

``NgramProposer`` is prompt lookup: the sequence's last ``n`` tokens (``n`` from ``max_n`` down to ``min_n``) are
looked up among its earlier tokens (the prompt and the answer so far), and the tokens that followed their latest
earlier occurrence are the guess. No model, no device memory: an index of the sequence's n-grams, kept up to date
token by token (``NgramState``, on the ``Sequence``).

Acceptance is tracked per sequence: one whose guesses keep failing stops being proposed for (``MISSES_TO_PAUSE``
steps in a row with nothing accepted pause it for ``PAUSE`` steps, doubling while it keeps failing). ``Speculation``
is what the batch holds: the proposer, how many tokens a row may guess, and the widest batch that speculates (a
wider step costs more to widen than its guesses save); it asks each running sequence for its guesses before a step
and records what was accepted (the counters ``/metrics`` shows)."""

from __future__ import annotations

from dataclasses import dataclass, field

MISSES_TO_PAUSE = 3
PAUSE = 8
MAX_PAUSE = 256


@dataclass
class NgramState:
    """One sequence's n-gram index and acceptance record (plain data, kept on its ``Sequence``)."""

    index: dict = field(default_factory=dict)  # n-gram (tuple) -> position of the token that followed it last
    indexed: int = 0  # positions p whose preceding n-grams are in ``index`` are those below this
    misses: int = 0  # steps in a row whose guesses were all refused
    paused: int = 0  # steps left without guesses
    pause: int = PAUSE  # the next pause's length
    proposed: int = 0  # guessed tokens, all steps
    accepted: int = 0  # of which accepted


class NgramProposer:
    """Prompt lookup: up to ``k`` tokens that followed the latest earlier occurrence of the sequence's last ``n``
    tokens, for ``n`` from ``max_n`` down to ``min_n`` (the longest match wins)."""

    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, state: NgramState, tokens: list[int], k: int) -> list[int]:
        """At most ``k`` guesses of what follows ``tokens`` (the sequence's prompt and output so far; the last one is
        the token the step feeds). Empty while the sequence is paused or nothing matches."""
        if k <= 0:
            return []
        if state.paused:
            state.paused -= 1
            return []
        index, end = state.index, len(tokens)
        # n-grams ending just before each position p < end (the token at p followed them); the latest wins
        for p in range(max(1, state.indexed), end):
            for n in range(self.min_n, self.max_n + 1):
                if p >= n:
                    index[tuple(tokens[p - n : p])] = p
        state.indexed = max(state.indexed, end)
        for n in range(self.max_n, self.min_n - 1, -1):
            if end >= n:
                at = index.get(tuple(tokens[end - n :]))
                if at is not None:
                    return tokens[at : at + k]
        return []

    @staticmethod
    def record(state: NgramState, proposed: int, accepted: int) -> None:
        """A verified guess: ``accepted`` of its ``proposed`` tokens were the sampler's."""
        state.proposed += proposed
        state.accepted += accepted
        if accepted:
            state.misses, state.pause = 0, PAUSE
            return
        state.misses += 1
        if state.misses >= MISSES_TO_PAUSE:
            state.paused, state.misses = state.pause, 0
            state.pause = min(2 * state.pause, MAX_PAUSE)


@dataclass(frozen=True)
class SpeculativeConfig:
    """The settings (SAKER_SPECULATIVE, _TOKENS, _MAX_ROWS, _NGRAM_MIN, _NGRAM_MAX)."""

    method: str = "off"
    tokens: int = 4
    max_rows: int = 4
    ngram_min: int = 2
    ngram_max: int = 4

    @classmethod
    def of(cls, settings) -> "SpeculativeConfig":
        return cls(
            settings.speculative,
            settings.speculative_tokens,
            settings.speculative_max_rows,
            settings.speculative_ngram_min,
            settings.speculative_ngram_max,
        )

    def build(self) -> "Speculation | None":
        if self.method == "ngram":
            return Speculation(NgramProposer(self.ngram_min, self.ngram_max), self.tokens, self.max_rows)
        return None


class Speculation:
    """The batch's speculative decoding: ``proposer`` guesses up to ``tokens`` tokens per row while the batch has at
    most ``max_rows`` rows. Counters over the engine's life: steps that checked guesses, rows that carried some, the
    tokens guessed and accepted, and acceptances per position in the guess (vLLM's ``spec_decode`` metrics)."""

    def __init__(self, proposer, tokens: int, max_rows: int):
        self.proposer, self.tokens, self.max_rows = proposer, tokens, max_rows
        self.drafts = 0  # rows that carried guesses into a step
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_per_position = [0] * tokens

    def counts(self) -> dict:
        return {
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
        }

    def guesses(self, groups) -> list[list[int]] | None:
        """Each running row's guesses (row order; empty where it has none), or None when no row has any. Rows of a
        constrained group guess nothing (their matcher would have to check each guess), nor does a row with no room
        left (``max_tokens``, the context) for a token past the one it makes anyway."""
        rows = sum(group.rows for group in groups)
        if rows > self.max_rows:
            return None
        out: list[list[int]] = []
        for group in groups:
            for seq in group.running:
                made = len(seq.output_ids)
                room = min(self.tokens, group.max_new - made - 1, group.max_length - len(seq.prompt_ids) - made - 1)
                if group.grammars is not None or room <= 0:
                    out.append([])
                    continue
                if seq.draft is None:
                    seq.draft = NgramState()
                out.append(self.proposer.propose(seq.draft, seq.prompt_ids + seq.output_ids, room))
        return out if any(out) else None

    def verified(self, groups, guesses: list[list[int]], accepted: list[int]) -> None:
        """The step checked ``guesses`` (row order) and kept ``accepted`` tokens of each."""
        row = 0
        for group in groups:
            for seq in group.running:
                guess, kept = guesses[row], accepted[row]
                row += 1
                if not guess:
                    continue
                self.proposer.record(seq.draft, len(guess), kept)
                group.timings.draft_tokens += len(guess)
                group.timings.accepted_tokens += kept
                self.drafts += 1
                self.draft_tokens += len(guess)
                self.accepted_tokens += kept
                for position in range(kept):
                    self.accepted_per_position[position] += 1
