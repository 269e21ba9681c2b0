"""``collect`` (a whole answer: each choice's tokens held, released once at the end) against the same events sent
as a stream (a release after every token, joined) and against the text itself: stop strings across tokens,
included or not, EOS and stop tokens, unfinished choices, several candidates, logprobs and their offsets. No model:
the events are made here the way ``ChoiceDecoder`` makes them (``text_decision`` on the text so far)."""

from __future__ import annotations

import random

import pytest

from app.engine.events import PromptEvent, TokenEvent
from app.engine.output.decoder import OutputStream, collect, join
from app.engine.output.stopping import StopStrings, text_decision
from app.engine.params import SamplingParams, TokenLogprobs

PIECES = ["a", "b", "ab", "ba", "c", " ", "", "xy", "é", "abc", "\n"]


def choice_events(rng: random.Random, index: int, params: SamplingParams, ending: str | None) -> list[TokenEvent]:
    """A candidate's events: random pieces until a stop string, or ``ending`` ("eos", "stop_token", "length") on
    the last token, or nothing (the answer was cut off with no finish: a cancelled request)."""
    stops = StopStrings(params.stop, params.include_stop_str_in_output)
    text, events = "", []
    count = rng.randint(0, 12)
    for i in range(count):
        piece = rng.choice(PIECES)
        before = len(text)
        text += piece
        ended = ending if i == count - 1 else None
        decision = text_decision(ended, text, before, i + 1, stops)
        logprob = -rng.random()
        event = TokenEvent(index, 100 + i, piece, logprob, {piece or "<empty>": logprob, "zz": -9.0})
        events.append(event)
        if decision.stop:
            event.finish_reason, event.text_end = decision.reason, decision.text_end
            break
    return events


def streamed(events, params: SamplingParams) -> dict[int, object]:
    """Every choice as a stream delivers it (``Worker.stream``): a release after each event, then the choices
    that never finished, joined."""
    stream = OutputStream(params)
    parts: dict[int, list] = {}
    for release in [release for event in events for release in stream.push(event)] + stream.finish():
        parts.setdefault(release.index, []).append(release)
    return {index: join(releases) for index, releases in parts.items()}


@pytest.mark.parametrize("case", range(300))
def test_collect_equals_the_joined_stream(case):
    rng = random.Random(case)
    stop = tuple(rng.sample(["ab", "ba", "c", "xy", "bab", "\n", "é "], rng.randint(0, 3)))
    params = SamplingParams(
        n=rng.choice([1, 2, 3]),
        stop=stop,
        include_stop_str_in_output=rng.random() < 0.5,
        logprobs=rng.choice([None, 1]),
        echo=rng.random() < 0.3,
    )
    prompt = PromptEvent(3, "the prompt" if params.echo else "", None)
    if params.echo and params.logprobs is not None:  # an echoed prompt carries its own token strings
        prompt.logprobs = TokenLogprobs(["the", " prompt"], [None, -1.5], [None, {" prompt": -1.5}], [0, 3])
    per_choice = [
        choice_events(rng, i, params, rng.choice(["eos", "stop_token", "length", None]))
        for i in range(params.num_candidates)
    ]
    events: list = [prompt]
    while any(per_choice):  # the candidates' events interleaved, each in its own order
        choice = rng.choice([c for c in per_choice if c])
        events.append(choice.pop(0))
    whole = collect(list(events), params)
    reference = streamed(list(events), params)
    assert len(whole.choices) == params.n
    for got in whole.choices:
        want = reference[got.index]
        assert got.text == want.text
        assert got.token_ids == want.token_ids
        assert got.finish_reason == (want.finish_reason or "length")
        if params.logprobs is None:
            assert got.logprobs is None
        else:
            assert got.logprobs.tokens == want.logprobs.tokens
            assert got.logprobs.token_logprobs == want.logprobs.token_logprobs
            assert got.logprobs.top_logprobs == want.logprobs.top_logprobs
            assert got.logprobs.text_offset == want.logprobs.text_offset
            # independent of either path: the token strings concatenate to the text, each at its offset
            assert "".join(got.logprobs.tokens) == got.text
            for token, offset in zip(got.logprobs.tokens, got.logprobs.text_offset):
                assert got.text[offset : offset + len(token)] == token


def test_a_stop_string_cuts_the_held_text():
    """Independent of the stream: a stop string spanning three tokens ends the text where it starts."""
    params = SamplingParams(stop=("abc",), logprobs=1)
    pieces = ["x", "a", "b", "cy"]
    events: list = [PromptEvent(2, "", None)]
    text, stops = "", StopStrings(params.stop)
    for i, piece in enumerate(pieces):
        before = len(text)
        text += piece
        decision = text_decision(None, text, before, i + 1, stops)
        event = TokenEvent(0, i, piece, -1.0, {piece: -1.0})
        if decision.stop:
            event.finish_reason, event.text_end = decision.reason, decision.text_end
        events.append(event)
    (choice,) = collect(events, params).choices
    assert choice.text == "x"
    assert choice.finish_reason == "stop"
    assert choice.logprobs.tokens == ["x", "", "", ""]
    assert choice.logprobs.text_offset == [0, 1, 1, 1]
