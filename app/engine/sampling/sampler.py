"""The batch-wide sampler: one pass over every row of a step, whatever each row asked for.

Each row's parameters live in per-row tensors (``SamplingRows``), so a step is a few tensor operations over the
whole batch, each skipped when no row needs it: ``allowed_token_ids``, logit bias, EOS/stop-token suppression
before ``min_tokens``,
repetition and presence/frequency penalties, temperature, top-k, top-p, min-p; then argmax for greedy rows and
an inverse-CDF draw for sampled rows. Raw logprobs (the model's own distribution, before any of this; the
processed one for rows with ``logprobs_mode: processed_logprobs``), the chosen token's logprob and the top k come
from the same pass, packed into one tensor: one transfer to the host.

Draws are counter-based: row ``i`` at its ``t``-th token uses the uniform number ``hash(seed_i, t)``, computed
in the step itself (no generator objects, nothing that depends on the other rows). So a request's samples do not
depend on what else is in the batch, a seed reproduces them, a stop string only cuts them, and the step has no
host-side state (a CUDA graph can hold it).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

from app.engine.model import cpu_kernels
from app.engine.sampling.grammar import RowGrammar, allowed_tokens, prefetch
from app.engine.sampling.logprobs import log_softmax
from app.engine.params import Constraint, SamplingParams

NEG_INF = float("-inf")
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # splitmix64 constants as signed int64
_M2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_STEP = 0xD1B54A32D192ED03 - (1 << 64)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (wrapping arithmetic)."""
    x = (x ^ _shift_right(x, 30)) * _M1
    x = (x ^ _shift_right(x, 27)) * _M2
    return x ^ _shift_right(x, 31)


def uniforms(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One float64 number in (0, 1) per row, a function of that row's seed and step only (52 random bits, so
    that ``bits + 0.5`` is exact and the largest value stays below 1)."""
    bits = _shift_right(_mix(seeds * _GOLDEN + steps * _STEP), 12)
    return (bits.double() + 0.5) * (1.0 / (1 << 52))


def sorted_descending(scores: torch.Tensor) -> torch.Tensor:
    """Each row's values, largest first (values only: thresholds need no indices). On the CPU numpy's SIMD sort
    is several times faster than torch's for this."""
    if scores.device.type == "cpu":
        import numpy as np

        return torch.from_numpy(np.ascontiguousarray(np.sort(scores.numpy(), axis=-1)[:, ::-1]))
    return torch.sort(scores, dim=-1, descending=True).values


def sequence_seed(seed: int | None, index: int) -> int:
    """Seed of candidate ``index`` of a request: its own stream, so a sequence's samples do not depend on the
    others (an unseeded request draws a random base)."""
    base = seed if seed is not None else secrets.randbits(63)
    return (base * 1_000_003 + index * 0x9E3779B1) % (2**63)


def _log_min_p(specs: list["RowSpec"], device) -> torch.Tensor:
    """(B,) float32: each row's log(min_p), -inf where it has none."""
    values = [math.log(s.min_p) if s.min_p > 0 else NEG_INF for s in specs]
    return torch.tensor(values, dtype=torch.float32, device=device)


@dataclass(frozen=True)
class RowSpec:
    """What one row asked for (host side: decides which passes a step needs)."""

    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition: float
    presence: float
    frequency: float
    min_tokens: int
    bias: tuple[tuple[int, float], ...]
    suppress: tuple[int, ...]  # ids kept out before min_tokens (EOS, stop tokens)
    logprobs: int  # top-k of the raw logprobs this row reports (0: none)
    wants_logprob: bool  # the chosen token's logprob (logprobs or best_of ranking)
    allowed: tuple[int, ...] | None = None  # only these may be chosen (allowed_token_ids)
    processed: bool = False  # report the processed distribution's logprobs, not the raw one
    constraint: Constraint | None = None  # structured outputs: each row's own matcher masks its scores

    @classmethod
    def of(cls, params: SamplingParams, suppress: tuple[int, ...], wants_logprob: bool) -> "RowSpec":
        sampled = not params.greedy
        return cls(
            greedy=params.greedy,
            temperature=params.temperature if sampled else 1.0,
            top_k=params.top_k if sampled and params.top_k > 0 else 0,
            top_p=params.top_p if sampled else 1.0,
            min_p=params.min_p if sampled else 0.0,
            repetition=params.repetition_penalty,
            presence=params.presence_penalty,
            frequency=params.frequency_penalty,
            min_tokens=params.min_tokens,
            bias=params.logit_bias,
            suppress=suppress if params.min_tokens > 0 else (),
            logprobs=params.logprobs or 0,
            wants_logprob=wants_logprob,
            allowed=params.allowed_token_ids,
            processed=params.processed_logprobs,
            constraint=params.constraint,
        )


class SamplingRows:
    """Per-row sampling parameters and history of a batch, in row order.

    Parameters are built once per membership change from the rows' ``RowSpec``s; the history (tokens generated
    so far, the counts/seen masks penalties need, constrained rows' matchers) follows its rows through
    ``select`` and ``cat``."""

    def __init__(
        self,
        specs: list[RowSpec],
        seeds: list[int],
        vocab: int,
        device,
        *,
        steps: torch.Tensor | None = None,
        counts: torch.Tensor | None = None,
        seen: torch.Tensor | None = None,
        grammars: list[RowGrammar | None] | None = None,
    ):
        self.specs, self.seed_list, self.vocab, self.device = specs, seeds, vocab, device
        self.grammars = grammars if grammars and any(g is not None for g in grammars) else None
        self.constrained = [i for i, g in enumerate(grammars) if g is not None] if self.grammars else []
        rows = len(specs)
        self._draw_columns: tuple[torch.Tensor, ...] | None = None
        self.greedy_all = all(s.greedy for s in specs)
        self.sampled_any = not self.greedy_all
        self.steps = steps if steps is not None else torch.zeros(rows, dtype=torch.long, device=device)
        self.seeds = torch.tensor(seeds, dtype=torch.long, device=device)
        self.k = max((s.logprobs for s in specs), default=0)
        self.wants_logprob = any(s.wants_logprob for s in specs)

        def column(name, dtype=torch.float32):
            return torch.tensor([getattr(s, name) for s in specs], dtype=dtype, device=device).view(-1, 1)

        mixed = self.sampled_any and any(s.greedy for s in specs)
        self.greedy = column("greedy", torch.bool).view(-1) if mixed else None
        self.temperature = column("temperature") if any(s.temperature != 1.0 for s in specs) else None
        self.top_k = column("top_k", torch.long) if any(s.top_k for s in specs) else None
        self.top_p = column("top_p") if any(s.top_p < 1.0 for s in specs) else None
        self.log_min_p = None
        if any(s.min_p > 0 for s in specs):
            self.log_min_p = _log_min_p(specs, device).view(-1, 1)
        self.repetition = column("repetition") if any(s.repetition != 1.0 for s in specs) else None
        self.presence = column("presence") if any(s.presence or s.frequency for s in specs) else None
        self.frequency = column("frequency") if self.presence is not None else None
        self.bias = None
        if any(s.bias for s in specs):
            self.bias = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
            for row, spec in enumerate(specs):
                for token, value in spec.bias:
                    self.bias[row, token] += value
        self.allowed = None
        if any(s.allowed is not None for s in specs):
            self.allowed = torch.ones(rows, vocab, dtype=torch.bool, device=device)
            for row, spec in enumerate(specs):
                if spec.allowed is not None:
                    self.allowed[row] = False
                    self.allowed[row, list(spec.allowed)] = True
        self.processed = None
        if any(s.processed for s in specs):
            self.processed = column("processed", torch.bool)
        self.suppress = self.min_tokens = None
        if any(s.suppress for s in specs):
            self.suppress = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
            for row, spec in enumerate(specs):
                if spec.suppress:
                    self.suppress[row, list(spec.suppress)] = True
            self.min_tokens = column("min_tokens", torch.long).view(-1)
        need_counts = self.presence is not None
        need_seen = self.repetition is not None
        self.counts = counts if need_counts else None
        self.seen = seen if need_seen else None
        if need_counts and self.counts is None:
            self.counts = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        if need_seen and self.seen is None:
            self.seen = torch.zeros(rows, vocab, dtype=torch.bool, device=device)

    @classmethod
    def for_prompt(
        cls,
        spec: RowSpec,
        seeds: list[int],
        prompt_ids: list[int],
        vocab: int,
        device,
        grammars: list[RowGrammar] | None = None,
    ) -> "SamplingRows":
        """The rows of one prompt's candidates (all with the same spec), before their first token."""
        rows = cls([spec] * len(seeds), seeds, vocab, device, grammars=grammars)
        if rows.seen is not None and prompt_ids:
            rows.seen[:, torch.tensor(prompt_ids, device=device)] = True
        return rows

    def __len__(self) -> int:
        return len(self.specs)

    def draw_columns(self) -> tuple[torch.Tensor, ...]:
        """Every row's greedy flag, temperature, top-k, top-p and log(min-p) (-inf: none), each (B,): the CPU
        sampler kernel's parameters (made once per membership)."""
        if self._draw_columns is None:
            specs, device = self.specs, self.device
            self._draw_columns = (
                torch.tensor([s.greedy for s in specs], dtype=torch.bool, device=device),
                torch.tensor([s.temperature for s in specs], dtype=torch.float32, device=device),
                torch.tensor([s.top_k for s in specs], dtype=torch.long, device=device),
                torch.tensor([s.top_p for s in specs], dtype=torch.float32, device=device),
                _log_min_p(specs, device),
            )
        return self._draw_columns

    # -- membership -------------------------------------------------------------------------------------------
    def select(self, keep: list[int]) -> "SamplingRows":
        """These rows only, in this order (their history goes with them)."""
        if keep == list(range(len(self.specs))):
            return self
        index = torch.tensor(keep, dtype=torch.long, device=self.device)

        def pick(t):
            return t.index_select(0, index) if t is not None else None

        return SamplingRows(
            [self.specs[i] for i in keep],
            [self.seed_list[i] for i in keep],
            self.vocab,
            self.device,
            steps=pick(self.steps),
            counts=pick(self.counts),
            seen=pick(self.seen),
            grammars=[self.grammars[i] for i in keep] if self.grammars else None,
        )

    @staticmethod
    def cat(parts: list["SamplingRows"]) -> "SamplingRows":
        nonempty = [p for p in parts if len(p)]
        if len(nonempty) <= 1:
            return nonempty[0] if nonempty else parts[0]
        parts = nonempty
        first = parts[0]

        def joined(name, dtype):
            if all(getattr(p, name) is None for p in parts):
                return None
            return torch.cat(
                [
                    getattr(p, name)
                    if getattr(p, name) is not None
                    else torch.zeros(len(p), first.vocab, dtype=dtype, device=first.device)
                    for p in parts
                ]
            )

        return SamplingRows(
            [s for p in parts for s in p.specs],
            [s for p in parts for s in p.seed_list],
            first.vocab,
            first.device,
            steps=torch.cat([p.steps for p in parts]),
            counts=joined("counts", torch.float32),
            seen=joined("seen", torch.bool),
            grammars=[g for p in parts for g in (p.grammars or [None] * len(p))],
        )

    def expand(self, guesses: list[list[int]], masks: dict[int, list] | None = None) -> "SamplingRows":
        """Speculative decoding: one row per token a row computes (its next token, then each of its ``guesses``),
        each as its row would stand at that token if the guesses before it were its own: its draw counter ``j``
        steps on, and the guesses before it in its penalty history. A row's sampler at each of its positions is
        then one batch-wide pass (``sample``), and a guess is kept while it is what that pass picks. A constrained row
        with guesses takes the masks of its positions from ``masks`` (row -> ``RowGrammar.masks_along``); one
        without keeps its grammar."""
        per_row = [1 + len(g) for g in guesses]
        which = [row for row, count in enumerate(per_row) for _ in range(count)]
        index = torch.tensor(which, dtype=torch.long, device=self.device)
        ahead = torch.tensor([j for count in per_row for j in range(count)], dtype=torch.long, device=self.device)

        def pick(t):
            return t.index_select(0, index) if t is not None else None

        out = SamplingRows(
            [self.specs[i] for i in which],
            [self.seed_list[i] for i in which],
            self.vocab,
            self.device,
            steps=self.steps.index_select(0, index) + ahead,
            counts=pick(self.counts),
            seen=pick(self.seen),
            grammars=self._position_grammars(per_row, masks or {}) if self.grammars else None,
        )
        out._add_history([guess[:j] for guess in guesses for j in range(len(guess) + 1)])
        return out

    def _position_grammars(self, per_row: list[int], masks: dict[int, list]) -> list:
        """The grammars of ``expand``'s positions: a constrained row's masks ahead, one per position, where it
        guessed; its own grammar where it did not."""
        from app.engine.sampling.grammar import FixedMask

        out = []
        for row, count in enumerate(per_row):
            grammar = self.grammars[row]
            if grammar is not None and count > 1:
                out += [FixedMask(mask) for mask in masks[row]]
            else:
                out += [grammar] * count
        return out

    def advance_grammar_runs(self, runs: list[list[int]], starts) -> set[int]:
        """Each constrained row's matcher takes the tokens of its run, in order (one token each after a plain step;
        the tokens a row kept after a speculative one). Returns the positions (``starts[row] + j``, in the step's
        numbering) at which a row's output became complete; the others' next masks start on the grammar thread."""
        if self.grammars is None:
            return set()
        complete, going = set(), []
        for row in self.constrained:
            grammar = self.grammars[row]
            if grammar.ended:
                complete.add(starts[row])
                continue
            for j, token in enumerate(runs[row]):
                if grammar.advance(token):
                    complete.add(starts[row] + j)
                    break
            else:
                going.append(grammar)
        prefetch(going)
        return complete

    def record_runs(self, runs: list[list[int]]) -> None:
        """After a speculative step: each row made the tokens of its run (history and draw counter, as ``record``
        for one token each)."""
        self.steps += torch.tensor([len(run) for run in runs], dtype=torch.long, device=self.device)
        self._add_history(runs)

    def _add_history(self, runs: list[list[int]]) -> None:
        """Each row's ``runs`` tokens join its penalty history (the counts and seen masks, where kept)."""
        if self.counts is None and self.seen is None:
            return
        width = max(1, max(len(run) for run in runs))
        ids = torch.tensor([run + [0] * (width - len(run)) for run in runs], dtype=torch.long, device=self.device)
        real = torch.tensor([[i < len(run) for i in range(width)] for run in runs], device=self.device)
        if self.counts is not None:
            self.counts.scatter_add_(1, ids, real.float())
        if self.seen is not None:
            self.seen |= torch.zeros_like(self.seen).scatter_(1, ids, real)

    def record(self, tokens: torch.Tensor) -> None:
        """After a step: every row has one more token (history for penalties, the counter for draws)."""
        self.steps += 1
        column = tokens.view(-1, 1)
        if self.counts is not None:
            self.counts.scatter_add_(1, column, torch.ones_like(column, dtype=torch.float32))
        if self.seen is not None:
            self.seen.scatter_(1, column, True)

    def advance_grammars(self, tokens: list[int]) -> set[int]:
        """Constrained rows consume their tokens (one each); the rows whose output is now complete. The others' next
        masks start on the grammar thread."""
        if self.grammars is None:
            return set()
        return self.advance_grammar_runs([[token] for token in tokens], range(len(tokens)))


# -- the pass ----------------------------------------------------------------------------------------------------
def shape_scores(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """Logits after every row's processing, in vocabulary order: -inf where a token may not be chosen. Greedy
    rows get bias, suppression and penalties only (their argmax is taken over these)."""
    scores = adjusted_scores(logits, rows)
    return scores if rows.greedy_all else truncated_scores(scores, rows)


def adjusted_scores(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """The processing every row gets, greedy or not: allowed tokens, the grammar's mask, logit bias, suppression
    before ``min_tokens``, and the penalties."""
    scores = logits
    if rows.allowed is not None:
        scores = scores.masked_fill(~rows.allowed, NEG_INF)
    if rows.grammars is not None:
        scores = scores.masked_fill(~grammar_mask(rows, scores.shape[-1], scores.device), NEG_INF)
    if rows.bias is not None:
        scores = scores + rows.bias
    if rows.suppress is not None:
        early = (rows.steps < rows.min_tokens).view(-1, 1)
        scores = scores.masked_fill(rows.suppress & early, NEG_INF)
    if rows.repetition is not None:
        penalized = torch.where(scores > 0, scores / rows.repetition, scores * rows.repetition)
        scores = torch.where(rows.seen, penalized, scores)
    if rows.presence is not None:
        scores = scores - rows.counts * rows.frequency - (rows.counts > 0).float() * rows.presence
    return scores


def truncated_scores(scores: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """What a sampled row draws from: its adjusted scores over its temperature, -inf where top-k, top-p or min-p
    leave a token out (a greedy row's unchanged)."""
    if rows.temperature is not None:
        scores = scores / rows.temperature
    if rows.top_k is not None or rows.top_p is not None:
        # both are thresholds on the sorted values: a token stays when its score reaches the row's threshold
        # (tokens tied with the last one kept all stay, whatever their ids)
        ordered = sorted_descending(scores)
        vocab = ordered.shape[-1]
        count = None  # (B, 1): how many of the sorted tokens stay
        if rows.top_k is not None:
            count = torch.where(rows.top_k > 0, rows.top_k.clamp(max=vocab), vocab)
        if rows.top_p is not None:
            probs = ordered.softmax(-1)
            cum = probs.cumsum(-1)
            # top-p over what top-k left: the mass above each token, as a share of the top k's mass
            mass = cum.gather(1, count - 1) if count is not None else 1.0
            nucleus = ((cum - probs) < rows.top_p * mass).sum(-1, keepdim=True).clamp(min=1)
            nucleus = torch.where(rows.top_p < 1.0, nucleus, vocab)
            count = nucleus if count is None else torch.minimum(count, nucleus)
        scores = scores.masked_fill(scores < ordered.gather(1, count - 1), NEG_INF)
    if rows.log_min_p is not None:  # p < min_p * p_max  <=>  s < s_max + log(min_p)
        scores = scores.masked_fill(scores < scores.max(-1, keepdim=True).values + rows.log_min_p, NEG_INF)
    return scores


def grammar_mask(rows: SamplingRows, vocab: int, device) -> torch.Tensor:
    """(B, V) bool: the tokens each constrained row's matcher allows (every token for the other rows)."""
    allowed = allowed_tokens([rows.grammars[i].current_mask() for i in rows.constrained], vocab, device)
    if len(rows.constrained) == len(rows):
        return allowed
    full = torch.ones(len(rows), vocab, dtype=torch.bool, device=device)
    full[torch.tensor(rows.constrained, device=device)] = allowed
    return full


def argmax(scores: torch.Tensor) -> torch.Tensor:
    """Each row's first argmax: saker's kernel on the CPU where it is built (``cpu_kernels.argmax_rows``), else
    PyTorch's (the same answer)."""
    if scores.device.type == "cpu" and scores.dtype == torch.float32 and cpu_kernels.kernel() is not None:
        return cpu_kernels.argmax_rows(scores)
    return scores.argmax(-1)


def choose(scores: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """Next token per row from shaped scores: argmax for greedy rows, an inverse-CDF draw for sampled rows."""
    if rows.greedy_all:
        return argmax(scores)
    cdf = scores.softmax(-1).cumsum(-1, dtype=torch.float64)
    # the token whose interval (cdf[i-1], cdf[i]] holds u * total: tokens without mass have empty intervals, and
    # u < 1 keeps the target at most the total, so the pick is never past the last token with mass
    target = uniforms(rows.seeds, rows.steps).view(-1, 1) * cdf[:, -1:]
    picks = torch.searchsorted(cdf, target).view(-1)
    if rows.greedy is not None:
        picks = torch.where(rows.greedy, argmax(scores), picks)
    return picks


@dataclass
class StepNumbers:
    """A step's results on the host: per row the token, and (when any row asks) its raw logprob and the top k;
    ``complete``: the constrained rows whose output this token completed."""

    tokens: list[int]
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_values: list[list[float]] | None = None
    complete: set[int] = frozenset()


def sample(logits: torch.Tensor, rows: SamplingRows, advance: bool = True) -> tuple[torch.Tensor, StepNumbers]:
    """One step for every row of ``logits`` (B, V) float32: tokens (on the device, to feed the next forward) and
    the numbers the output side needs, brought to the host in one transfer. ``advance``: constrained rows' matchers
    take their tokens (not for a speculative step's positions: ``SamplingRows.advance_grammar_runs`` does that for
    the tokens kept).

    On the CPU, where saker's kernels are built, a batch with sampled rows makes its choice in one kernel call
    (``cpu_kernels.sample_tokens``: temperature, top-k, top-p, min-p and the draw per row, OpenMP over the rows)
    instead of the 30-odd tensor operations of ``truncated_scores`` and ``choose``, whose sort of the whole
    vocabulary for top-p was most of a sampled step's cost (docs/performance.md, "The sampler in one kernel")."""
    scores = adjusted_scores(logits, rows)
    if rows.greedy_all:
        tokens = argmax(scores)
    elif scores.device.type == "cpu" and rows.processed is None and cpu_kernels.kernel() is not None:
        tokens = cpu_kernels.sample_tokens(scores, *rows.draw_columns(), rows.seeds, rows.steps)
    else:  # (rows reporting processed logprobs report the distribution these operations drew from)
        scores = truncated_scores(scores, rows)
        tokens = choose(scores, rows)
    rows.record(tokens)
    if not rows.wants_logprob:
        numbers = StepNumbers(tokens.tolist())
        numbers.complete = rows.advance_grammars(numbers.tokens) if advance else set()
        return tokens, numbers
    lp = log_softmax(logits)  # exact to float32 rounding on every CPU (``logprobs.log_softmax``)
    if rows.processed is not None:  # logprobs_mode processed_logprobs: what the row sampled from
        lp = torch.where(rows.processed, log_softmax(scores), lp)
    column = tokens.view(-1, 1)
    parts = [column.double(), lp.gather(-1, column).double()]
    k = rows.k
    if k:
        top = torch.topk(lp, k, dim=-1)
        parts += [top.values.double(), top.indices.double()]
    host = torch.cat(parts, dim=1).tolist()  # float64 holds float32 values and token ids exactly
    numbers = StepNumbers([int(r[0]) for r in host], [r[1] for r in host])
    numbers.complete = rows.advance_grammars(numbers.tokens) if advance else set()
    if k:
        numbers.top_values = [r[2 : 2 + k] for r in host]
        numbers.top_ids = [[int(i) for i in r[2 + k :]] for r in host]
    return tokens, numbers
