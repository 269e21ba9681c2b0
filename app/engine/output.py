"""Per-choice output assembly, shared by plain and streamed answers so that both read the same.

A ``ChoiceAssembler`` takes a candidate's TokenEvents and releases whole tokens once their text is final:
text that could still be the start of a stop string is held back (``StopStrings.holdback``); at the end the
text is cut at the stop and the last tokens are clipped so that the token strings concatenate to the text.
``collect`` drains a Generator through assemblers; streaming sends each release as it comes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

from app.engine.generate import PromptEvent, TokenEvent
from app.engine.params import SamplingParams, TokenLogprobs
from app.engine.stopping import StopStrings


@dataclass
class Release:
    """Text of one choice that is final, with the logprobs of the tokens it holds."""
    index: int
    text: str
    logprobs: TokenLogprobs | None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class ChoiceAssembler:
    def __init__(self, index: int, params: SamplingParams, text_offset: int = 0):
        self.index = index
        self.want_logprobs = params.logprobs is not None
        self.stops = StopStrings(params.stop, params.include_stop_str_in_output)
        self.offset = text_offset           # text_offset of the next released token
        self.text = ""                      # all generated text so far (held-back part included)
        self.released = 0                   # how much of self.text is out
        self.pending: list[TokenEvent] = []
        self.token_count = 0
        self.logprob_sum = 0.0
        self.finish_reason: str | None = None

    def add(self, event: TokenEvent) -> Release | None:
        self.pending.append(event)
        self.text += event.text
        self.token_count += 1
        if event.logprob is not None:
            self.logprob_sum += event.logprob
        if event.finish_reason:
            self.finish_reason = event.finish_reason
            end = len(self.text) if event.text_end is None else event.text_end
            return self._release(end, everything=True)
        return self._release(len(self.text) - self.stops.holdback(self.text), everything=False)

    def _release(self, limit: int, everything: bool) -> Release | None:
        """Release pending tokens whose text ends within ``limit`` (all of them, clipped, when finishing)."""
        out = Release(self.index, "", TokenLogprobs() if self.want_logprobs else None)
        taken = 0
        for event in self.pending:
            piece = event.text
            if self.released + len(piece) > limit:
                if not everything:
                    break
                piece = piece[:max(0, limit - self.released)]
            taken += 1
            out.text += piece
            out.token_ids.append(event.token_id)
            if out.logprobs is not None:
                out.logprobs.tokens.append(piece)
                out.logprobs.token_logprobs.append(event.logprob)
                out.logprobs.top_logprobs.append(event.top_logprobs)
                out.logprobs.text_offset.append(self.offset)
            self.offset += len(piece)
            self.released += len(piece)
        self.pending = self.pending[taken:]
        if everything:
            out.finish_reason = self.finish_reason
        if not taken and not everything:
            return None
        return out

    @property
    def mean_logprob(self) -> float:
        return self.logprob_sum / self.token_count if self.token_count else 0.0


def prompt_release(prompt: PromptEvent, index: int, params: SamplingParams) -> Release:
    """The echoed prompt as the first release of a choice (empty without echo)."""
    if not params.echo:
        return Release(index, "", TokenLogprobs() if params.logprobs is not None else None)
    logprobs = None
    if params.logprobs is not None and prompt.logprobs is not None:
        lp = prompt.logprobs
        logprobs = TokenLogprobs(list(lp.tokens), list(lp.token_logprobs), list(lp.top_logprobs),
                                 list(lp.text_offset))
    return Release(index, prompt.text, logprobs)


def merge(into: Release, more: Release) -> Release:
    into.text += more.text
    into.token_ids += more.token_ids
    if into.logprobs is not None and more.logprobs is not None:
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(into.logprobs, name).extend(getattr(more.logprobs, name))
    if more.finish_reason:
        into.finish_reason = more.finish_reason
    return into


class OutputStream:
    """Turns a Generator's events into Releases: the prompt's first, then each choice's as text becomes final."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.prompt: PromptEvent | None = None
        self.assemblers: list[ChoiceAssembler] = []

    def push(self, event: PromptEvent | TokenEvent) -> list[Release]:
        """What this event makes final (the prompt's event opens every choice)."""
        if isinstance(event, PromptEvent):
            self.prompt = event
            base = len(event.text) if self.params.echo else 0
            self.assemblers = [ChoiceAssembler(i, self.params, base) for i in range(self.params.num_candidates)]
            return [prompt_release(event, i, self.params) for i in range(self.params.num_candidates)]
        release = self.assemblers[event.index].add(event)
        return [release] if release is not None else []

    def finish(self) -> list[Release]:
        """After the last event: choices that got no tokens at all (max_tokens 0) end here."""
        out = []
        for assembler in self.assemblers:
            if assembler.finish_reason is None:
                assembler.finish_reason = "length"
                out.append(Release(assembler.index, "", TokenLogprobs() if assembler.want_logprobs else None,
                                   finish_reason="length"))
        return out

    def feed(self, events: Iterable[PromptEvent | TokenEvent]) -> Iterator[Release]:
        for event in events:
            yield from self.push(event)
        yield from self.finish()

    @property
    def completion_tokens(self) -> int:
        return sum(a.token_count for a in self.assemblers)


@dataclass
class ChoiceResult:
    index: int                    # candidate index
    text: str                     # echoed prompt text + completion text
    finish_reason: str | None
    token_ids: list[int]
    logprobs: TokenLogprobs | None
    mean_logprob: float


@dataclass
class CompletionOutput:
    prompt_tokens: int
    choices: list[ChoiceResult]   # the n kept candidates, in output order
    completion_tokens: int        # all candidates' tokens (best_of included)


def collect(events: Iterable[PromptEvent | TokenEvent], params: SamplingParams) -> CompletionOutput:
    """Drain events into finished choices: the same releases a stream sends, joined."""
    stream = OutputStream(params)
    joined: dict[int, Release] = {}
    for release in stream.feed(events):
        if release.index in joined:
            merge(joined[release.index], release)
        else:
            joined[release.index] = release
    assert stream.prompt is not None
    results = []
    for i in range(params.num_candidates):
        release = joined[i]
        assembler = stream.assemblers[i]
        results.append(ChoiceResult(i, release.text, release.finish_reason or "length", release.token_ids,
                                    release.logprobs, assembler.mean_logprob))
    if params.num_candidates > params.n:
        results = sorted(results, key=lambda r: -r.mean_logprob)[:params.n]
    return CompletionOutput(stream.prompt.prompt_tokens, results, stream.completion_tokens)
