"""SAKER_ENGINE_PROCESS: the model loop in a process of its own. Answers equal references outside the engine
(greedy text and logprobs: a plain forward's argmax and log-softmax; seeded samples with stop strings, ``n`` and
``best_of``: the sampler's documented counter-based draws over that forward, ``references.ref_sampled``; a
constrained answer: the same under llguidance's own masks), with and without speculation; a cancelled stream stops
the engine's work, and a dead engine fails the requests that were waiting with a clear error instead of hanging
them."""

from __future__ import annotations

import time

import pytest

from app.engine.params import Constraint, SamplingParams
from conftest import make_settings
from references import check_reference, continuation, grammar_allowed, ref_logprobs, ref_sampled

TOL = 1e-5


@pytest.fixture(scope="module")
def remote(gpt2_dir):
    from app.engine.core.worker import Worker

    worker = Worker.from_settings(make_settings(model=str(gpt2_dir), engine_process=True, speculative="off"))
    worker.load()
    yield worker
    worker.engine.close()


REQUESTS = [
    SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.8, seed=5, n=3, stop=("e", "a"), logprobs=0),
    SamplingParams(max_tokens=6, temperature=0.0, echo=True, logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=0.7, seed=2, best_of=3, n=2, top_p=0.9),
    SamplingParams(
        max_tokens=30,
        temperature=0.9,
        seed=4,
        n=2,
        logprobs=1,
        constraint=Constraint("regex", "[a-z]{2,8}@[a-z]{2,5}\\.com"),
    ),
]


def check_answers(prompts, params, outputs, model, tok) -> None:
    """Each answer against the references: chosen tokens' logprobs and top logprobs a plain forward's log-softmax,
    greedy picks its argmax (``check_reference``); sampled tokens the documented draws over it, cut where a stop
    string first appears; with ``best_of`` the kept candidates the ``n`` of highest mean reference logprob."""
    constraint = params.constraint
    eos = None if params.ignore_eos else tok.eos_token_id
    allowed = grammar_allowed(tok, constraint.source, tok.eos_token_id) if constraint else None
    for ids, output in zip(prompts, outputs):
        check_reference(output, model, tok, ids, params, tol=1e-4)
        assert output.prompt_tokens == len(ids)
        for choice in output.choices:
            made = choice.token_ids
            want = ref_sampled(
                model, ids, params, choice.index, params.max_tokens, allowed=allowed, eos=eos, follow=made
            )
            assert made == want[: len(made)]
            text = continuation(tok, ids, ids + want)
            cuts = [text.index(stop) for stop in params.stop if stop in text]
            if cuts:
                assert (choice.finish_reason, choice.text) == ("stop", text[: min(cuts)])
            else:
                assert made == want
                ended = (eos is not None and want[-1] == eos) or (allowed is not None and allowed.complete(want))
                assert choice.finish_reason == ("stop" if ended else "length")
                assert choice.text.endswith(text) if params.echo else choice.text == text
        if params.best_of and params.best_of > params.n:
            means = []
            for index in range(params.best_of):
                tokens = ref_sampled(model, ids, params, index, params.max_tokens, eos=eos)
                lp = ref_logprobs(model, ids + tokens)
                means.append(sum(lp[len(ids) - 1 + i, t].item() for i, t in enumerate(tokens)) / len(tokens))
            best = sorted(range(params.best_of), key=lambda i: -means[i])[: params.n]
            assert sorted(c.index for c in output.choices) == sorted(best)
        else:
            assert [c.index for c in output.choices] == list(range(params.n))


@pytest.mark.parametrize("params", REQUESTS, ids=["greedy-logprobs", "n-stop", "echo", "best_of", "constrained"])
def test_answers_equal_the_references(remote, params, reference, gpt2_dir):
    """Oracle: transformers' own model (``check_answers``)."""
    model, tok = reference(gpt2_dir)
    assert remote.engine.process.is_alive() and remote.prefix_cache is None
    prompts = [remote.encode("The capital of France is"), remote.encode("Once upon a time")]
    got, got_timings = remote.complete(prompts, params, 256)
    check_answers(prompts, params, got, model, tok)
    assert got_timings.prefill_s > 0 and got_timings.generated_tokens == sum(o.completion_tokens for o in got)


def test_a_dropped_stream_stops_the_engine(remote):
    ids = remote.encode("Hello")
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    from app.engine.params import Timings

    stream = remote.stream([ids], params, 256, Timings())
    for n, _ in enumerate(stream):
        if n == 3:
            break
    stream.close()  # the client went away
    steps = remote.engine.steps
    (after,), _ = remote.complete([ids], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), 256)
    assert after.completion_tokens == 2
    assert remote.engine.steps - steps < 150  # the dropped request did not run on to 200 tokens


def test_a_dead_engine_fails_waiting_requests(gpt2_dir):
    from app.engine.core.worker import Worker

    worker = Worker.from_settings(make_settings(model=str(gpt2_dir), engine_process=True))
    worker.load()
    ids = worker.encode("Hello")
    events = worker.events(
        [ids],
        SamplingParams(max_tokens=5000, temperature=0.0, ignore_eos=True),
        256,
        __import__("app.engine.params", fromlist=["Timings"]).Timings(),
    )
    next(events)  # running
    worker.engine.process.kill()
    with pytest.raises(RuntimeError, match="engine process exited"):
        for _ in events:
            pass
    from app.engine.errors import EngineNotReady

    assert not worker.ready  # /health turns 503 and new requests are refused
    with pytest.raises(EngineNotReady, match="engine process exited"):
        worker.require_ready()


def test_the_engine_process_keeps_the_one_queue_and_its_answers_cross_the_pipe(gpt2_dir):
    """The waiting queue lives in the engine process's scheduler: with one running slot and no waiting place, a
    second request gets QueueFull (the 429) through the pipe while the first runs, and the queue's counts reach
    the serving side (what /metrics reads)."""
    from app.engine.errors import QueueFull
    from app.engine.params import Timings
    from app.engine.core.worker import Worker

    worker = Worker.from_settings(
        make_settings(model=str(gpt2_dir), engine_process=True, max_running_requests=1, max_queue=0)
    )
    worker.load()
    try:
        ids = worker.encode("Hello")
        first = worker.stream([ids], SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True), 600, Timings())
        next(first)  # running: it holds the one slot
        with pytest.raises(QueueFull) as info:
            worker.complete([ids], SamplingParams(max_tokens=2, temperature=0.0), 256)
        assert (info.value.waiting, info.value.limit) == (0, 0)
        for n, _ in enumerate(first):  # the next iteration's message carries the counts
            if n == 2:
                break
        assert worker.queue_snapshot() == {"active": 1, "waiting": 0, "rejected": 1, "timed_out": 0}
        first.close()  # the engine gives the slot back at its next step, and says so in that iteration's message
        deadline = time.monotonic() + 60  # a safety net only
        while worker.queue_snapshot()["active"] and time.monotonic() < deadline:
            time.sleep(0.01)
        (after,), _ = worker.complete([ids], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), 256)
        assert after.completion_tokens == 2  # the slot came back
    finally:
        worker.engine.close()


def test_speculation_in_the_engine_process_answers_as_the_references_and_reports_acceptance(gpt2_dir, reference):
    """SAKER_SPECULATIVE=ngram with the engine in its own process: the answers equal the references (oracle:
    ``check_answers``, a plain forward's argmax, log-softmax and counter-based draws), the request's timing carries
    its guesses, and the client sees the engine's counters (what /metrics shows). The prompt is one token over and
    over and a logit bias makes it the answer too, so prompt lookup's guesses (what followed it before: itself) must
    be kept."""
    from app.engine.core.worker import Worker

    model, tok = reference(gpt2_dir)
    settings = make_settings(model=str(gpt2_dir), engine_process=True, speculative="ngram", speculative_ngram_min=1)
    remote = Worker.from_settings(settings)
    remote.load()
    try:
        word = remote.encode("red")[-1]
        prompts = [[word] * 10, remote.encode("red green blue red green blue red green blue red")]
        forced = SamplingParams(
            max_tokens=30, temperature=0.0, logprobs=1, ignore_eos=True, logit_bias=((word, 100.0),)
        )
        (got,), timings = remote.complete(prompts[:1], forced, 256)
        check_answers(prompts[:1], forced, [got], model, tok)
        assert got.choices[0].token_ids == [word] * 30
        counts = remote.engine.speculation_counts
        assert timings.accepted_tokens == timings.draft_tokens > 0
        assert counts["draft_tokens"] == timings.draft_tokens and counts["accepted_tokens"] == timings.accepted_tokens
        for params in REQUESTS[:2]:  # greedy and seeded samples with stop strings, beside each other
            outputs, _ = remote.complete(prompts, params, 256)
            check_answers(prompts, params, outputs, model, tok)
    finally:
        remote.engine.close()
