"""Speculative decoding (``SAKER_SPECULATIVE``): the proposers: guesses of a sequence's next tokens, which one forward
of the target checks (``step.decode_step``: a row with ``k`` guesses computes ``1 + k`` positions in the step's
flat forward, and keeps the guesses its own sampler would have picked).

- ``NgramProposer`` is prompt lookup: the sequence's last ``n`` tokens (``n`` from ``max_n`` down to ``min_n``) are
  looked up among its earlier tokens (the prompt and the answer so far), and the tokens that followed their latest
  earlier occurrence are the guess. No model, no device memory: an index of the sequence's n-grams, kept up to date
  token by token (``NgramState``, on the ``Sequence``).
- ``DraftProposer`` is a draft model: a smaller causal LM with the target's vocabulary (``SAKER_SPECULATIVE_MODEL``)
  guesses greedily for every guessing row at once, ``k`` flat forwards a step, over a block pool of its own (a
  ``BlockBatch`` of the draft's). A sequence's blocks are cut back to the tokens the sequence kept before the next
  guess (``DraftState``).

Acceptance is tracked per sequence: one whose guesses keep failing stops being proposed for (``MISSES_TO_PAUSE``
steps in a row with nothing accepted pause it for ``PAUSE`` steps, doubling while it keeps failing). ``Speculation``
is what the batch holds: the proposer, how many tokens a row may guess, and the widest batch that speculates (a
wider step costs more to widen than its guesses save); it asks each running sequence for its guesses before a step
and records what was accepted (the counters ``/metrics`` shows)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from app.engine.model.load_config import LoadConfig
from app.engine.model.loader import speculative_method as method  # the setting as it applies on this device

MISSES_TO_PAUSE = 3
PAUSE = 8
MAX_PAUSE = 256
INDEX_PER_STEP = 512  # prompt lookup: earlier positions a sequence's n-gram index takes in per guess


@dataclass
class ProposerState:
    """One sequence's acceptance record (plain data, kept on its ``Sequence``)."""

    misses: int = 0  # steps in a row whose guesses were all refused
    paused: int = 0  # steps left without guesses
    pause: int = PAUSE  # the next pause's length
    proposed: int = 0  # guessed tokens, all steps
    accepted: int = 0  # of which accepted


class Proposer:
    """What every proposer shares: no guesses while a sequence is paused, and the acceptance record."""

    state_type = ProposerState

    def propose_rows(self, states: list, tokens: list[list[int]], ks: list[int]) -> list[list[int]]:
        """For each row, at most ``ks[i]`` guesses of what follows ``tokens[i]`` (the sequence's prompt and output so
        far; the last one is the token the step feeds). Empty while the sequence is paused or there is no guess."""
        asked = []
        for state, k in zip(states, ks):
            if k > 0 and state.paused:
                state.paused -= 1
                k = 0
            asked.append(max(k, 0))
        return self.guess_rows(states, tokens, asked)

    def propose(self, state: ProposerState, tokens: list[int], k: int) -> list[int]:
        """``propose_rows`` for one sequence."""
        return self.propose_rows([state], [tokens], [k])[0]

    def guess_rows(self, states: list, tokens: list[list[int]], ks: list[int]) -> list[list[int]]:
        """The guesses of the rows not paused (``ks[i]`` 0: none); row by row unless a proposer batches them."""
        return [self.guess(state, seq, k) if k else [] for state, seq, k in zip(states, tokens, ks)]

    def guess(self, state, tokens: list[int], k: int) -> list[int]:
        raise NotImplementedError

    def forget(self, state) -> None:
        """The sequence ended: what the proposer holds for it goes (a draft's blocks)."""

    def release_all(self) -> None:
        """A step failed: the proposer lets go of everything it holds for every sequence."""

    def held_blocks(self) -> int:
        """Blocks of a pool of its own held now (a draft's; 0 for a proposer with none)."""
        return 0

    @staticmethod
    def record(state: ProposerState, proposed: int, accepted: int) -> None:
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


@dataclass
class NgramState(ProposerState):
    """A sequence's n-gram index: the positions ``[low, high)`` are in it (made from the newest end back)."""

    index: dict = field(default_factory=dict)  # n-gram (tuple) -> position of the token that followed it last
    low: int = -1  # -1: nothing indexed yet
    high: int = 0


class NgramProposer(Proposer):
    """Prompt lookup: up to ``k`` tokens that followed the latest earlier occurrence of the sequence's last ``n``
    tokens, for ``n`` from ``max_n`` down to ``min_n`` (the longest match wins)."""

    state_type = NgramState

    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n

    def guess(self, state: NgramState, tokens: list[int], k: int) -> list[int]:
        index, end = state.index, len(tokens)
        # n-grams ending just before each position p < end (the token at p followed them); the latest wins. The
        # positions the sequence made since the last guess go in first (they are the newest); then at most
        # INDEX_PER_STEP older ones, from the newest back (never over a newer one), so that a long prompt's index
        # is made over several steps instead of stalling one (8,000 positions take about 25 ms)
        if state.low < 0:
            state.low = state.high = end
        for p in range(state.high, end):
            for n in range(self.min_n, self.max_n + 1):
                if p >= n:
                    index[tuple(tokens[p - n : p])] = p
        state.high = end
        stop = max(1, state.low - INDEX_PER_STEP)
        for p in range(state.low - 1, stop - 1, -1):
            for n in range(self.min_n, self.max_n + 1):
                if p >= n:
                    index.setdefault(tuple(tokens[p - n : p]), p)
        state.low = min(state.low, stop)
        for n in range(self.max_n, self.min_n - 1, -1):
            if end >= n:
                at = index.get(tuple(tokens[end - n :]))
                if at is not None:
                    return tokens[at : at + k]
        return []


@dataclass
class DraftState(ProposerState):
    """A sequence's place in the draft's block pool: its blocks in order, and the tokens whose keys and values they
    hold."""

    blocks: list = field(default_factory=list)
    held: list = field(default_factory=list)


CATCH_UP = 512  # draft: most of a sequence's tokens its blocks take in per step (a long prompt over several steps)


class DraftProposer(Proposer):
    """A draft model's greedy guesses for every guessing row at once, over a block pool of its own: a ``BlockBatch``
    of the draft's ``ModelRunner`` (its pool, its block manager, its flat forward), whose rows are the guessing
    sequences' chunks. The first forward of a step feeds each row the tokens its blocks lack (the prompt at its first
    guess, ``CATCH_UP`` tokens a step; after that the tokens kept since its last guess, one or two), then one forward
    per further guess, every row in it. A row's held tokens are cut back to the longest prefix they share with the
    sequence, so refused guesses leave nothing behind (their positions are written again).

    The pool holds ``rows`` sequences at the draft's whole context (the most that guess in one step); when a row needs
    blocks and none are free, the sequence that guessed least recently gives its blocks up (and is fed from the start
    if it guesses again). A row past the draft's context guesses nothing."""

    state_type = DraftState

    def __init__(self, runner, vocab: int, rows: int, tokens: int):
        from collections import OrderedDict

        from app.engine.core.batches import BlockBatch
        from app.engine.core.blocks import BLOCK

        self.runner, self.vocab = runner, vocab  # the served model's vocabulary: no guess outside it
        self.context = runner.context_length
        self.batch = BlockBatch(runner, rows * (-(-(self.context + tokens) // BLOCK) + 1) * BLOCK)
        self.batch.make_pool()  # and its block count, at once (blocks are zeroed when first handed out)
        self.holding: OrderedDict[int, DraftState] = OrderedDict()  # states with blocks, least recently guessing first

    def guess_rows(self, states: list, tokens: list[list[int]], ks: list[int]) -> list[list[int]]:
        import torch

        out: list[list[int]] = [[] for _ in states]
        now = {id(state) for state, k in zip(states, ks) if k}
        jobs = []  # (row, state, its tokens, first position fed, end of the feed)
        for row, (state, seq, k) in enumerate(zip(states, tokens, ks)):
            if not k or len(seq) + k > self.context:
                continue
            same = _shared(state.held, seq)
            del state.held[same:]
            end = min(len(seq), same + CATCH_UP)
            if not self._fit(state, end + (k - 1 if end == len(seq) else 0), now):
                continue
            jobs.append((row, state, seq, same, end))
        if not jobs:
            return out
        chunks = [
            (state.blocks, seq[same:end], same, "last" if end == len(seq) else "none")
            for _, state, seq, same, end in jobs
        ]
        with torch.inference_mode():
            _, logits = self.batch.forward_with_chunks(chunks, with_rows=False)
            going = []  # rows fed up to their last token: they guess
            for row, state, seq, same, end in jobs:
                state.held.extend(seq[same:end])
                if end == len(seq):
                    going.append((row, state, seq))
            while going:
                for (row, _, _), token in zip(going, self._greedy(logits)):
                    out[row].append(token)
                going = [(row, state, seq) for row, state, seq in going if len(out[row]) < ks[row]]
                if going:
                    chunks = [
                        (state.blocks, out[row][-1:], len(seq) + len(out[row]) - 1, "last") for row, state, seq in going
                    ]
                    _, logits = self.batch.forward_with_chunks(chunks, with_rows=False)
                    for row, state, _ in going:
                        state.held.append(out[row][-1])
        return out

    def forget(self, state: DraftState) -> None:
        if self.holding.pop(id(state), None) is not None:
            self.batch.blocks.release(state.blocks)
        state.blocks, state.held = [], []

    def release_all(self) -> None:
        for state in list(self.holding.values()):
            self.forget(state)

    def held_blocks(self) -> int:
        return self.batch.blocks.held_blocks

    def _greedy(self, logits: list) -> list[int]:
        """The greedy token after each chunk that kept its last logits (those that kept none are empty), within the
        served model's vocabulary: one transfer for all of them."""
        import torch

        return torch.cat([last[-1:, : self.vocab] for last in logits]).argmax(-1).tolist()

    def _fit(self, state: DraftState, positions: int, now: set[int]) -> bool:
        """Blocks for ``positions`` positions on ``state`` (taken from the sequences that guessed least recently, not
        those of this step, when none are free); False when they cannot be had."""
        from app.engine.core.blocks import BLOCK

        self.holding[id(state)] = state
        self.holding.move_to_end(id(state))
        more = -(-positions // BLOCK) - len(state.blocks)
        blocks = self.batch.blocks
        while more > blocks.free_blocks:
            idle = next((key for key in self.holding if key not in now), None)
            if idle is None:
                return False
            gone = self.holding.pop(idle)
            blocks.release(gone.blocks)
            gone.blocks, gone.held = [], []
        if more > 0:
            state.blocks += self.batch._allocate(more)
        return True


def _shared(held: list[int], tokens: list[int]) -> int:
    """How many leading tokens ``held`` and ``tokens`` share, at most all of ``tokens`` but the last (always fed: its
    logits give the first guess)."""
    import numpy as np

    same = min(len(held), len(tokens) - 1)
    if same:
        differ = np.nonzero(np.asarray(held[:same]) != np.asarray(tokens[:same]))[0]
        same = int(differ[0]) if differ.size else same
    return same


@dataclass(frozen=True)
class SpeculativeConfig:
    """The settings (SAKER_SPECULATIVE, _TOKENS, _MAX_ROWS, _NGRAM_MIN, _NGRAM_MAX)."""

    method: str = "off"
    tokens: int = 4
    max_rows: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    draft: Callable[[], object] | None = None  # loads the draft model (``loader.LoadedModel``)

    @classmethod
    def of(cls, settings) -> "SpeculativeConfig":
        load_config = LoadConfig.of(settings)
        draft = None
        if settings.speculative == "draft":
            from app.engine.model.loader import load_model

            draft_config = load_config.draft(settings.speculative_model)

            def draft():
                return load_model(draft_config)

        return cls(
            method(load_config),
            settings.speculative_tokens,
            settings.speculative_max_rows,
            settings.speculative_ngram_min,
            settings.speculative_ngram_max,
            draft,
        )

    def build(self, runner) -> "Speculation | None":
        """The batch's ``Speculation`` (None: off); a draft model is loaded here and must share the served model's
        (``runner``'s) tokenizer vocabulary (ConfigError otherwise)."""
        if self.method == "ngram":
            return Speculation(NgramProposer(self.ngram_min, self.ngram_max), self.tokens, self.max_rows)
        if self.method == "draft":
            from app.engine.errors import ConfigError

            loaded = self.draft()
            if loaded.tokenizer.get_vocab() != runner.tokenizer.get_vocab():
                raise ConfigError(
                    f"the speculative model ({loaded.source}) has another vocabulary than the served model's: a draft "
                    "model must use the same tokenizer"
                )
            from app.engine.model.runner import ModelRunner

            draft = ModelRunner(loaded.model, loaded.tokenizer, ())
            proposer = DraftProposer(draft, runner.vocab_size, self.max_rows, self.tokens)
            return Speculation(proposer, self.tokens, self.max_rows)
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
        """Each running row's guesses (row order; empty where it has none), or None when no row has any. A
        constrained row's guesses are cut to those its grammar allows, in order; a row with no room left
        (``max_tokens``, the context) for a token past the one it makes anyway guesses nothing."""
        rows = sum(group.rows for group in groups)
        if rows > self.max_rows:
            return None
        states, tokens, rooms, grammars = [], [], [], []
        for group in groups:
            for seq in group.running:
                made = len(seq.output_ids)
                room = min(self.tokens, group.max_new - made - 1, group.max_length - len(seq.prompt_ids) - made - 1)
                if seq.draft is None:
                    seq.draft = self.proposer.state_type()
                states.append(seq.draft)
                rooms.append(room)
                # the sequence's tokens only where they are read (a long prompt is a long copy every step)
                tokens.append(seq.prompt_ids + seq.output_ids if room > 0 and not seq.draft.paused else [])
                grammars.append(None if group.grammars is None else group.grammars[seq.index])
        out = self.proposer.propose_rows(states, tokens, rooms)
        for row, grammar in enumerate(grammars):
            if out[row] and grammar is not None:
                out[row] = out[row][: grammar.allows(out[row])]
        return out if any(out) else None

    def forget(self, seqs) -> None:
        """The sequences ended (or failed): the proposer lets go of what it holds for them."""
        for seq in seqs:
            if seq.draft is not None:
                self.proposer.forget(seq.draft)

    def release_all(self) -> None:
        self.proposer.release_all()

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
