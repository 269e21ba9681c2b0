"""Stop rules, each evaluated in one place: token-level ones by the engine (``StoppingCriteria.ended_by``: EOS, stop
tokens, max_tokens, the context, a completed constrained output), stop strings by the output side on the text
(``StopStrings``, with holdback), which turns the engine's reason and the strings into a ``StopDecision``
(``text_decision``)."""

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
    """The engine's per-sequence stop rules, on token ids alone: EOS (unless ignore_eos) and stop tokens (once
    min_tokens are out), max_tokens, the context. Stop strings need text: they are the output side's
    (``text_decision``)."""

    def __init__(
        self,
        *,
        eos_token_ids: frozenset[int],
        stop_token_ids: tuple[int, ...] = (),
        ignore_eos: bool = False,
        min_tokens: int = 0,
        max_tokens: int | None = None,
        max_length: int | None = None,
    ):
        self.eos = frozenset() if ignore_eos else eos_token_ids
        self.stop_token_ids = frozenset(stop_token_ids)
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens
        self.max_length = max_length

    def ended_by(self, token_id: int, num_generated: int, total_length: int, complete: bool = False) -> str | None:
        """Why this token ends the sequence, or None: ``"eos"`` or ``"stop_token"`` (the token itself, min_tokens
        permitting), ``"complete"`` (``complete``: it completed a constrained output), ``"length"`` (max_tokens or
        the context reached)."""
        if num_generated >= self.min_tokens:
            if token_id in self.eos:
                return "eos"
            if token_id in self.stop_token_ids:
                return "stop_token"
        if complete:
            return "complete"
        if self.max_tokens is not None and num_generated >= self.max_tokens:
            return "length"
        if self.max_length is not None and total_length >= self.max_length:
            return "length"
        return None


def text_decision(
    ended: str | None, text: str, text_before: int, num_generated: int, stops: StopStrings, min_tokens: int = 0
) -> StopDecision:
    """The output side's decision for one token: the engine's reason (``ended``, ``StoppingCriteria.ended_by``) and
    the stop strings. ``text``: the generated text so far (this token included); ``text_before``: its length before.
    An EOS or stop token ends the text before itself (a stop token's text is kept with include_stop_str_in_output);
    a stop string (once min_tokens are out) cuts where it starts (or ends, included); a completed constrained
    output is ``stop``, max_tokens or the context ``length``."""
    if ended == "eos" or (ended == "stop_token" and not stops.include):
        return StopDecision(True, "stop", text_before)
    if ended == "stop_token":
        return StopDecision(True, "stop", len(text))
    if num_generated >= min_tokens:
        end = stops.find(text, text_before)
        if end is not None:
            return StopDecision(True, "stop", end)
    if ended == "complete":
        return StopDecision(True, "stop")
    if ended == "length":
        return StopDecision(True, "length")
    return CONTINUE
