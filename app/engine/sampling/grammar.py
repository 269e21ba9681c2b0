"""Structured outputs: a request's ``Constraint`` (JSON schema, regex, choice, Lark/GBNF grammar) compiled by
llguidance into one matcher per row; the sampler masks each constrained row's scores to the tokens its matcher
allows.

- ``Grammars`` (one per tokenizer and vocabulary): the llguidance tokenizer, made once, and compiled grammars
  cached by constraint. ``compile`` raises ``GrammarError`` with llguidance's message for a schema, regex or
  grammar it cannot take (the serving side turns it into a 400 before the request is admitted).
- ``RowGrammar``: one row's matcher and its next mask. After a step the row consumes its token and the mask for
  the next step is computed on the grammar thread (llguidance drops the GIL), while the model thread runs the
  next forward; the sampler waits for it only when it needs it.

Why llguidance and not xgrammar (measured on this machine, SmolLM2's 49k vocabulary, a 6-field schema with a
pattern, an enum array and a nested object): masks take 6 us (median; 1.4 ms at worst) against xgrammar's 2 us
(4.8 ms at worst), both far below a decode step; a schema compiles in 1.4 ms against 93 ms (this is paid on the
request's thread before admission, so it is latency every constrained request sees); it has no dependencies
(xgrammar pulls triton, 1 GB, and a TVM runtime) and it takes Lark grammars, regexes and the widest JSON
Schema coverage (JSONSchemaBench). The tokenizer is built once per model (0.3 s for 49k tokens).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from app.engine.output.detokenize import tokenizer_memo
from app.engine.sampling.json_schemas import closed_objects, json_options
from app.engine.params import Constraint

CACHE_SIZE = 256
# The longest run of digits a constrained output may write while its grammar allows something else: JSON numbers
# have no length bound, and a model that wants to go on where the grammar forbids it (another key of a closed
# object) may keep writing digits until max_tokens (``25.5283231251111...``), a failure every constrained decoder
# has met. Past 32 digits (a float64 holds 17 significant ones) tokens that begin with a digit are masked whenever
# the grammar allows another token; a grammar that wants only digits (a pattern such as ``[0-9]{40}``) keeps them.
DIGIT_RUN = 32
_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="saker-grammar")


class GrammarError(ValueError):
    """A constraint llguidance cannot compile (its message says why)."""


def grammar_text(constraint: Constraint) -> str:
    """The constraint as an llguidance grammar (its JSON form)."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    kind, source = constraint.kind, constraint.source
    try:
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(
                closed_objects(json.loads(source)), defaults=json_options(constraint.whitespace)
            )
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(source)
        if kind == "choice":
            choices = json.loads(source)
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
            )
        if kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(source))
    except (ValueError, TypeError) as exc:  # gbnf_to_lark and the JSON schema reader raise on bad input
        raise GrammarError(str(exc)) from None
    raise GrammarError(f"unknown constraint kind {kind!r}")


class Grammars:
    """Compiled constraints for one tokenizer and model vocabulary (thread-safe; compile on any thread)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.hf_tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, tuple(eos_token_ids)
        self.words = (vocab_size + 31) // 32  # int32 words of one row's bitmask
        self._lltok = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[Constraint, object] = OrderedDict()
        self._digits: DigitTokens | None = None

    @property
    def lltok(self):
        """llguidance's view of the tokenizer (every token's bytes), made once."""
        if self._lltok is None:
            with self._lock:
                if self._lltok is None:
                    import llguidance.hf

                    try:
                        self._lltok = llguidance.hf.from_tokenizer(
                            self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids) or None
                        )
                    except Exception as exc:
                        raise GrammarError(
                            f"structured outputs are not available for this tokenizer "
                            f"({type(self.hf_tokenizer).__name__}): {exc}"
                        ) from None
        return self._lltok

    def compile(self, constraint: Constraint):
        """The constraint's matcher in its start state (cached; ``matcher`` hands out copies)."""
        with self._lock:
            if constraint in self._compiled:
                self._compiled.move_to_end(constraint)
                return self._compiled[constraint]
        import llguidance

        matcher = llguidance.LLMatcher(self.lltok, grammar_text(constraint), log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        with self._lock:
            self._compiled[constraint] = matcher
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher

    def matcher(self, constraint: Constraint):
        """A fresh matcher for one row."""
        return self.compile(constraint).deep_copy()

    def row(self, constraint: Constraint) -> "RowGrammar":
        return RowGrammar(self.matcher(constraint), self.words, self.digits)

    @property
    def digits(self) -> "DigitTokens":
        """Which tokens begin with a digit and how many digits each ends with (made once, on first use)."""
        if self._digits is None:
            lltok = self.lltok
            with self._lock:
                if self._digits is None:
                    self._digits = DigitTokens([lltok.decode_bytes([t]) for t in range(self.vocab_size)], self.words)
        return self._digits


class DigitTokens:
    """Per token, from its bytes: whether it begins with an ASCII digit (a bitmask in the matcher's layout), how
    many digits it ends with, and whether it is digits only (then it extends a run instead of ending one).

    Made and used off the model thread (a request's thread, the grammar thread), so with numpy: a torch operation
    large enough to run in parallel gives that thread an OpenMP team of its own, and from then on the model thread's
    forwards ran about 2x slower on 2 cores (22.4 against 10.6 ms per step for SmolLM2, every request, constrained or
    not, once the first constrained request had been compiled)."""

    def __init__(self, pieces: list[bytes], words: int):
        self.trailing = [len(p) - len(p.rstrip(b"0123456789")) for p in pieces]
        self.only = [bool(p) and n == len(p) for p, n in zip(pieces, self.trailing)]
        leading = np.zeros(words * 32, dtype=bool)
        leading[[t for t, p in enumerate(pieces) if p[:1].isdigit()]] = True
        # bit t % 32 of word t // 32, as the matcher lays its masks out (little-endian words)
        self.leading = np.packbits(leading.reshape(words, 32), axis=1, bitorder="little").view("<i4").reshape(words)

    def run_after(self, run: int, token_id: int) -> int:
        """The output's trailing run of digits once ``token_id`` follows a run of ``run``."""
        if token_id >= len(self.only):
            return 0
        return run + self.trailing[token_id] if self.only[token_id] else self.trailing[token_id]


def grammars_for(tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Grammars:
    """The ``Grammars`` of a tokenizer and model vocabulary (one per process)."""
    return tokenizer_memo(tokenizer, f"grammars_{vocab_size}", lambda: Grammars(tokenizer, vocab_size, eos_token_ids))


class RowGrammar:
    """One row's matcher and the bitmask of the tokens it allows next (bit ``t % 32`` of word ``t // 32``)."""

    def __init__(self, matcher, words: int, digits: DigitTokens | None = None):
        self.matcher = matcher
        self.mask = torch.empty(words, dtype=torch.int32)
        self.digits = digits
        self.run = 0  # digits the output ends with (``DIGIT_RUN``)
        self._next: Future | None = None  # the mask being computed on the grammar thread
        self._fresh = False  # ``mask`` is the current state's
        self.ended = False  # the output is complete (or the matcher failed)

    def _fill(self) -> None:
        self.matcher.unsafe_compute_mask_ptr(self.mask.data_ptr(), self.mask.numel() * 4)
        if self.run >= DIGIT_RUN and self.digits is not None:  # numpy: this runs on the grammar thread
            other = self.mask.numpy() & ~self.digits.leading
            if other.any():
                self.mask = torch.from_numpy(other)
        self._fresh = True

    def current_mask(self) -> torch.Tensor:
        """The mask for the row's next token (waits for the grammar thread, or computes it here)."""
        if self._next is not None:
            self._next.result()
            self._next = None
        if not self._fresh:
            self._fill()
        return self.mask

    def advance(self, token_id: int) -> bool:
        """The row chose ``token_id``: whether its output is now complete (nothing but the end may follow), or
        the matcher refused the token (it cannot: the token came from its mask)."""
        self._fresh = False
        if self.digits is not None:
            self.run = self.digits.run_after(self.run, token_id)
        ok = self.matcher.consume_token(token_id)
        self.ended = not ok or self.matcher.is_stopped()
        return self.ended

    def allows(self, tokens: list[int]) -> int:
        """Speculative decoding: how many of ``tokens``, in order, the matcher would take now (its state unchanged)."""
        if self.ended or not tokens:
            return 0
        self.current_mask()  # the grammar thread is done with the matcher
        return self.matcher.validate_tokens(tokens)

    def masks_along(self, tokens: list[int]) -> list[torch.Tensor]:
        """Speculative decoding: the masks of the row's next ``1 + len(tokens)`` positions had it taken ``tokens``
        (which ``allows`` says it would): the current mask, then the mask after each token. The row's state is put
        back as it was (the matcher rolled back, the digit run and the current mask restored)."""
        masks = [self.current_mask().clone()]
        run, ended = self.run, self.ended
        for token in tokens:
            self.advance(token)
            if not self.ended:  # past a token that completes the output nothing is kept: any mask will do
                self._fill()
            masks.append(self.mask.clone())
        if tokens:
            self.matcher.rollback(len(tokens))
        self.run, self.ended, self.mask, self._fresh = run, ended, masks[0].clone(), True
        return masks


class FixedMask:
    """A position's mask computed ahead (``RowGrammar.masks_along``), standing in for a row's grammar in the sampler's
    pass over a speculative step's positions."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask

    def current_mask(self) -> torch.Tensor:
        return self.mask


def prefetch(rows: list[RowGrammar]) -> None:
    """Compute these rows' next masks on the grammar thread (the model thread runs the next forward meanwhile)."""
    if not rows:
        return
    future: Future = _POOL.submit(_fill_all, rows)
    for row in rows:
        row._next = future


def _fill_all(rows: list[RowGrammar]) -> None:
    for row in rows:
        row._fill()


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def allowed_tokens(masks: list[torch.Tensor], vocab: int, device) -> torch.Tensor:
    """(rows, vocab) bool from per-row bitmasks."""
    words = torch.stack(masks).to(device, non_blocking=True)
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return bits.view(words.shape[0], -1)[:, :vocab].bool()
