"""The output side, off the model thread: numbers in, text out.

A ``RequestDecoder`` turns one prompt's engine events (``PromptNumbers``, ``TokenNumbers``) into text events: a
``ChoiceDecoder`` per candidate owns its incremental detokenizer, its stop rules (stop strings included) and the
``top_logprobs`` keys. It runs on the thread of the request that reads the events; when a stop string ends a
candidate it tells the engine (``RequestGroup.finish_candidate``), whose row then leaves at the next step; tokens
the row made after the stop are dropped here, never returned nor counted.

A ``ChoiceAssembler`` takes a candidate's TokenEvents and releases whole tokens once their text is final:
text that could still be the start of a stop string is held back (``StopStrings.holdback``); at the end the
text is cut at the stop and the last tokens are clipped so that the token strings concatenate to the text.
``collect`` drains a request's events (a ``SoloRun``'s, a ticket's) through assemblers; streaming sends each
release as it comes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import itemgetter
from typing import Iterable

from app.engine.output.detokenize import IncrementalDetokenizer
from app.engine.events import PromptEvent, PromptNumbers, TokenEvent, TokenNumbers
from app.engine.output.token_text import candidate_keys
from app.engine.params import SamplingParams, TokenLogprobs
from app.engine.output.stopping import StopDecision, StopStrings, text_decision


_NO_CHANCE = float("-inf")


def _top_dict(
    tokenizer,
    byte_level: bool,
    detok: IncrementalDetokenizer,
    chosen_id: int,
    chosen_lp: float,
    ids: list[int],
    vals: list[float],
    as_ids: bool = False,
) -> dict[str, float]:
    """``top_logprobs`` of one position: the top k plus the chosen token, keyed by their text in context (or
    ``token_id:<id>`` with return_tokens_as_token_ids)."""
    # tokens a processed distribution ruled out (-inf: a constraint's mask, allowed_token_ids, top-k) are no
    # alternatives (and -Infinity is not JSON)
    cand_ids, cand_vals = [chosen_id], [chosen_lp]
    for i, v in zip(ids, vals):
        if i != chosen_id and v != _NO_CHANCE:
            cand_ids.append(i)
            cand_vals.append(v)
    keys = [f"token_id:{i}" for i in cand_ids] if as_ids else candidate_keys(tokenizer, detok, cand_ids, byte_level)
    # highest first; a stable sort keeps ties in candidate order (the chosen token first)
    return dict(sorted(zip(keys, cand_vals), key=itemgetter(1), reverse=True))


class ChoiceDecoder:
    """One candidate's text: detokenizer, stop rules, logprob keys."""

    def __init__(
        self,
        index: int,
        tokenizer,
        byte_level: bool,
        prompt_ids: list[int],
        params: SamplingParams,
        stops: StopStrings,
    ):
        self.index = index
        self.tokenizer, self.byte_level = tokenizer, byte_level
        self.want_logprobs = params.logprobs is not None
        self.as_ids = params.tokens_as_ids
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.stops, self.min_tokens = stops, params.min_tokens
        self.generated = 0
        self.text = ""
        self.finished = False

    def token(self, raw: TokenNumbers) -> TokenEvent | None:
        """The text event of this token; None once the candidate has finished (a row that ran on past its stop
        string until the engine heard of it)."""
        if self.finished:
            return None
        token_id, detok = raw.token_id, self.detok
        top_dict = None
        if self.want_logprobs:
            top_dict = _top_dict(
                self.tokenizer,
                self.byte_level,
                detok,
                token_id,
                raw.logprob,
                raw.top_ids or [],
                raw.top_values or [],
                self.as_ids,
            )
        self.generated += 1
        piece = ""
        if raw.ended in ("eos", "stop_token"):
            piece = detok.flush()  # bytes held before an EOS/stop token are final now
            self.text += piece
        before = len(self.text)
        added = detok.add(token_id)
        piece += added
        self.text += added
        decision = text_decision(raw.ended, self.text, before, self.generated, self.stops, self.min_tokens)
        if decision.stop and decision.text_end in (None, len(self.text)):
            tail = detok.flush()
            piece += tail
            self.text += tail
            if decision.text_end is not None:
                decision = StopDecision(True, decision.reason, len(self.text))
        event = TokenEvent(self.index, token_id, piece, raw.logprob, top_dict)
        if decision.stop:
            event.finish_reason = decision.reason
            event.text_end = decision.text_end
            self.finished = True
        return event


class RequestDecoder:
    """The output side of one prompt of a request (a ``RequestGroup``): engine events in, text events out. A stop
    string that ends a candidate before the engine did is told to the engine through ``finish(group, index)`` (the
    request's ``Ticket``: in process or across the engine process's pipe alike)."""

    def __init__(self, group, tokenizer, byte_level: bool, finish=None):
        self.group = group
        self.finish = finish if finish is not None else (lambda group, index: group.finish_candidate(index))
        self.tokenizer, self.byte_level, self.params = tokenizer, byte_level, group.params
        self.prompt_ids = group.prompt_ids
        self.choices: list[ChoiceDecoder] = []
        self.generated_tokens = 0

    def push(self, numbers: PromptNumbers | TokenNumbers) -> list[PromptEvent | TokenEvent]:
        if isinstance(numbers, PromptNumbers):
            return [self.prompt(numbers)]
        if not self.choices:
            self._open()
        choice = self.choices[numbers.index]
        event = choice.token(numbers)
        if event is None:
            return []
        self.generated_tokens += 1
        if event.finish_reason and numbers.ended is None:
            self.finish(self.group, numbers.index)  # a stop string: the engine's row must leave
        return [event]

    def _open(self) -> None:
        params = self.params
        stops = StopStrings(params.stop, params.include_stop_str_in_output)
        self.choices = [
            ChoiceDecoder(
                i,
                self.tokenizer,
                self.byte_level,
                self.prompt_ids,
                params,
                stops,
            )
            for i in range(params.num_candidates)
        ]

    def prompt(self, numbers: PromptNumbers) -> PromptEvent:
        """The prompt's text and (with echo + logprobs) its tokens, logprobs and keys; with prompt_logprobs, those
        in vLLM's shape."""
        event = self._echo(numbers)
        if self.params.prompt_logprobs is not None and numbers.logprobs is not None:
            event.prompt_logprobs = self._prompt_logprobs(numbers)
        return event

    def _prompt_logprobs(self, numbers: PromptNumbers) -> list:
        """``[None, {"<id>": {"logprob", "rank", "decoded_token"}, ...}, ...]``: the prompt token first, then the
        top k (ranked 1..k) that are not it."""
        k, names = self.params.prompt_logprobs, {}

        def decoded(token_id: int) -> str:
            if token_id not in names:
                names[token_id] = (
                    f"token_id:{token_id}" if self.params.tokens_as_ids else self.tokenizer.decode([token_id])
                )
            return names[token_id]

        out: list = [None]
        for i, token_id in enumerate(self.prompt_ids[1:]):
            entry = {
                str(token_id): {
                    "logprob": numbers.logprobs[i],
                    "rank": numbers.ranks[i],
                    "decoded_token": decoded(token_id),
                }
            }
            ids = numbers.top_ids[i][:k] if numbers.top_ids else []
            values = numbers.top_values[i][:k] if numbers.top_values else []
            for rank, (other, value) in enumerate(zip(ids, values), start=1):
                entry.setdefault(str(other), {"logprob": value, "rank": rank, "decoded_token": decoded(other)})
            out.append(entry)
        return out

    def _echo(self, numbers: PromptNumbers) -> PromptEvent:
        params, tok, ids = self.params, self.tokenizer, self.prompt_ids
        if not params.echo:
            return PromptEvent(numbers.prompt_tokens, "", None)
        if params.logprobs is None or numbers.logprobs is None:
            text = tok.decode(ids, skip_special_tokens=params.skip_special_tokens)
            return PromptEvent(numbers.prompt_tokens, text, None)
        k = params.logprobs
        detok = IncrementalDetokenizer(tok, skip_special_tokens=params.skip_special_tokens)
        out = TokenLogprobs()
        text = ""
        for i, token_id in enumerate(ids):
            if i == 0:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                chosen = numbers.logprobs[i - 1]
                out.token_logprobs.append(chosen)
                out.top_logprobs.append(
                    _top_dict(
                        tok,
                        self.byte_level,
                        detok,
                        token_id,
                        chosen,
                        numbers.top_ids[i - 1][:k] if numbers.top_ids else [],
                        numbers.top_values[i - 1][:k] if numbers.top_values else [],
                        params.tokens_as_ids,
                    )
                )
            piece = detok.add(token_id)
            out.text_offset.append(len(text))
            out.tokens.append(f"token_id:{token_id}" if params.tokens_as_ids else piece)
            text += piece
        tail = detok.flush()
        if tail:
            if not params.tokens_as_ids:
                out.tokens[-1] += tail
            text += tail
        return PromptEvent(numbers.prompt_tokens, text, out)


@dataclass
class Release:
    """Text of one choice that is final, with the logprobs of the tokens it holds."""

    index: int
    text: str
    logprobs: TokenLogprobs | None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list | None = None  # on the prompt's release of each choice, with prompt_logprobs


class ChoiceAssembler:
    def __init__(self, index: int, params: SamplingParams, text_offset: int = 0):
        self.index = index
        self.want_logprobs = params.logprobs is not None
        self.as_ids = params.tokens_as_ids
        self.stops = StopStrings(params.stop, params.include_stop_str_in_output)
        self.offset = text_offset  # text_offset of the next released token
        self.text = ""  # all generated text so far (held-back part included)
        self.released = 0  # how much of self.text is out
        self.pending: list[TokenEvent] = []
        self.token_count = 0
        self.logprob_sum = 0.0
        self.finish_reason: str | None = None
        self.text_end: int | None = None  # where the finished text ends (None: its whole length)

    def add(self, event: TokenEvent) -> Release | None:
        """Take a token; what it makes final (a stream sends each release as it comes)."""
        self.hold(event)
        return self.release()

    def hold(self, event: TokenEvent) -> None:
        """Take a token without releasing anything yet (a whole answer releases once, at its end: ``collect``)."""
        self.pending.append(event)
        self.text += event.text
        self.token_count += 1
        if event.logprob is not None:
            self.logprob_sum += event.logprob
        if event.finish_reason:
            self.finish_reason = event.finish_reason
            self.text_end = event.text_end

    def release(self) -> Release | None:
        """What the tokens taken so far make final: all of them, cut at the stop, once the choice has finished;
        otherwise those whose text can no longer be the start of a stop string. Releasing after every token or
        once after many gives the same text, tokens and offsets (released text is never taken back)."""
        if self.finish_reason is not None:
            end = len(self.text) if self.text_end is None else self.text_end
            return self._release(end, everything=True)
        return self._release(len(self.text) - self.stops.holdback(self.text), everything=False)

    def _release(self, limit: int, everything: bool) -> Release | None:
        """Release pending tokens whose text ends within ``limit`` (all of them, clipped, when finishing)."""
        pieces: list[str] = []
        offsets: list[int] = []
        released = self.released
        for event in self.pending:
            piece = event.text
            if released + len(piece) > limit:
                if not everything:
                    break
                piece = piece[: max(0, limit - released)]
            pieces.append(piece)
            offsets.append(self.offset + released - self.released)
            released += len(piece)
        if not pieces and not everything:
            return None
        events = self.pending[: len(pieces)]
        del self.pending[: len(pieces)]
        logprobs = None
        if self.want_logprobs:
            logprobs = TokenLogprobs(
                [f"token_id:{event.token_id}" for event in events] if self.as_ids else pieces,
                [event.logprob for event in events],
                [event.top_logprobs for event in events],
                offsets,
            )
        self.offset += released - self.released
        self.released = released
        return Release(
            self.index,
            "".join(pieces),
            logprobs,
            [event.token_id for event in events],
            self.finish_reason if everything else None,
        )

    @property
    def mean_logprob(self) -> float:
        return self.logprob_sum / self.token_count if self.token_count else 0.0


def prompt_release(prompt: PromptEvent, index: int, params: SamplingParams) -> Release:
    """The echoed prompt as the first release of a choice (empty without echo), with prompt_logprobs when asked."""
    if not params.echo:
        return Release(
            index, "", TokenLogprobs() if params.logprobs is not None else None, prompt_logprobs=prompt.prompt_logprobs
        )
    logprobs = None
    if params.logprobs is not None and prompt.logprobs is not None:
        lp = prompt.logprobs
        logprobs = TokenLogprobs(list(lp.tokens), list(lp.token_logprobs), list(lp.top_logprobs), list(lp.text_offset))
    return Release(index, prompt.text, logprobs, prompt_logprobs=prompt.prompt_logprobs)


def join(releases: list[Release]) -> Release:
    """One choice's releases in order as one (its text, tokens and logprobs end to end)."""
    first = releases[0]
    if len(releases) == 1:
        return first
    logprobs = None
    if first.logprobs is not None:
        parts = [r.logprobs for r in releases if r.logprobs is not None]
        logprobs = TokenLogprobs(
            [token for part in parts for token in part.tokens],
            [value for part in parts for value in part.token_logprobs],
            [top for part in parts for top in part.top_logprobs],
            [offset for part in parts for offset in part.text_offset],
        )
    return Release(
        first.index,
        "".join(r.text for r in releases),
        logprobs,
        [token_id for r in releases for token_id in r.token_ids],
        next((r.finish_reason for r in reversed(releases) if r.finish_reason), None),
        first.prompt_logprobs,
    )


class OutputStream:
    """Turns a request's events into Releases: the prompt's first, then each choice's as text becomes final."""

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
                out.append(
                    Release(
                        assembler.index,
                        "",
                        TokenLogprobs() if assembler.want_logprobs else None,
                        finish_reason="length",
                    )
                )
        return out

    @property
    def completion_tokens(self) -> int:
        return sum(a.token_count for a in self.assemblers)


@dataclass
class ChoiceResult:
    index: int  # candidate index
    text: str  # echoed prompt text + completion text
    finish_reason: str | None
    token_ids: list[int]
    logprobs: TokenLogprobs | None
    mean_logprob: float


@dataclass
class CompletionOutput:
    prompt_tokens: int
    choices: list[ChoiceResult]  # the n kept candidates, in output order
    completion_tokens: int  # all candidates' tokens (best_of included)
    prompt_logprobs: list | None = None


def collect(events: Iterable[PromptEvent | TokenEvent], params: SamplingParams) -> CompletionOutput:
    """Drain events into finished choices: what the releases a stream sends join to. Each choice's tokens are
    held and released once, at the end (the same text, tokens and offsets as releasing after every token)."""
    stream = OutputStream(params)
    made: list[Release] = []
    for event in events:
        if isinstance(event, PromptEvent):
            made += stream.push(event)
        else:
            stream.assemblers[event.index].hold(event)
    made += [release for release in map(ChoiceAssembler.release, stream.assemblers) if release is not None]
    made += stream.finish()
    releases: dict[int, list[Release]] = {}
    for release in made:
        releases.setdefault(release.index, []).append(release)
    joined = {index: join(parts) for index, parts in releases.items()}
    assert stream.prompt is not None
    results = []
    for i in range(params.num_candidates):
        release = joined[i]
        assembler = stream.assemblers[i]
        results.append(
            ChoiceResult(
                i,
                release.text,
                release.finish_reason or "length",
                release.token_ids,
                release.logprobs,
                assembler.mean_logprob,
            )
        )
    if params.num_candidates > params.n:
        results = sorted(results, key=lambda r: -r.mean_logprob)[: params.n]
    return CompletionOutput(
        stream.prompt.prompt_tokens, results, stream.completion_tokens, stream.prompt.prompt_logprobs
    )
