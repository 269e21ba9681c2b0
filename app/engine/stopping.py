"""Stop decisions: ``StoppingCriteria(...) -> (stop, reason)``, and stop-string matching with holdback."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopDecision:
    stop: bool
    reason: str | None = None  # "stop" | "length"
    text_end: int | None = None  # where the returned text ends (stop strings and stop tokens cut it)


CONTINUE = StopDecision(False)


class StopStrings:
    """Finds stop strings in generated text, across token boundaries."""

    def __init__(self, stops: tuple[str, ...], include_in_output: bool = False):
        self.stops = tuple(s for s in stops if s)
        self.include = include_in_output
        self.longest = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, new_from: int) -> int | None:
        """End of the returned text if a stop string occurs in ``text`` ending after ``new_from``; else None."""
        if not self.stops:
            return None
        best: tuple[int, int] | None = None
        for stop in self.stops:
            at = text.find(stop, max(0, new_from - len(stop) + 1))
            if at != -1 and (best is None or at < best[0]):
                best = (at, len(stop))
        if best is None:
            return None
        return best[0] + best[1] if self.include else best[0]

    def holdback(self, text: str) -> int:
        """How many trailing characters could still be the start of a stop string (not safe to release)."""
        for size in range(min(self.longest - 1, len(text)), 0, -1):
            tail = text[-size:]
            if any(stop.startswith(tail) for stop in self.stops):
                return size
        return 0


class StoppingCriteria:
    """Per-sequence stop rules: EOS (unless ignore_eos), stop tokens, stop strings, min/max tokens, context."""

    def __init__(
        self,
        *,
        eos_token_ids: frozenset[int],
        stop_token_ids: tuple[int, ...] = (),
        stop_strings: StopStrings | None = None,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        max_tokens: int | None = None,
        max_length: int | None = None,
    ):
        self.eos = frozenset() if ignore_eos else eos_token_ids
        self.stop_token_ids = frozenset(stop_token_ids)
        self.stop_strings = stop_strings or StopStrings(())
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens
        self.max_length = max_length

    def stop_token(self, token_id: int, num_generated: int) -> str | None:
        """ "eos" or "stop_token" when this token ends the sequence by itself (min_tokens permitting)."""
        if num_generated < self.min_tokens:
            return None
        if token_id in self.eos:
            return "eos"
        if token_id in self.stop_token_ids:
            return "stop_token"
        return None

    def ends(self, token_id: int, num_generated: int, total_length: int) -> bool:
        """The token-level part of the rules (no text): whether this token ends the sequence by itself (EOS, a
        stop token), or the sequence is at max_tokens or the context. What the engine decides on its own; stop
        strings are the output side's."""
        if self.stop_token(token_id, num_generated) is not None:
            return True
        if self.max_tokens is not None and num_generated >= self.max_tokens:
            return True
        return self.max_length is not None and total_length >= self.max_length

    def __call__(
        self, token_id: int, text: str, text_before: int, num_generated: int, total_length: int
    ) -> StopDecision:
        """``text``: the generated text so far (this token included); ``text_before``: its length before.
        An EOS or stop token ends the text before itself (a stop token's text is kept with
        include_stop_str_in_output)."""
        if num_generated >= self.min_tokens:
            kind = self.stop_token(token_id, num_generated)
            if kind == "eos" or (kind == "stop_token" and not self.stop_strings.include):
                return StopDecision(True, "stop", text_before)
            if kind == "stop_token":
                return StopDecision(True, "stop", len(text))
            end = self.stop_strings.find(text, text_before)
            if end is not None:
                return StopDecision(True, "stop", end)
        if self.max_tokens is not None and num_generated >= self.max_tokens:
            return StopDecision(True, "length")
        if self.max_length is not None and total_length >= self.max_length:
            return StopDecision(True, "length")
        return CONTINUE
