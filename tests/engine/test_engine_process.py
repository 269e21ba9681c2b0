"""SAKER_ENGINE_PROCESS: the model loop in a process of its own. Answers equal the in-process engine's (greedy
text and logprobs, seeded samples with stop strings and n), a cancelled stream stops the engine's work, and a
dead engine fails the requests that were waiting with a clear error instead of hanging them."""

from __future__ import annotations

import time

import pytest

from app.engine.params import Constraint, SamplingParams
from conftest import make_settings
from references import check_reference

TOL = 1e-5


@pytest.fixture(scope="module")
def workers(gpt2_dir):
    from app.engine.worker import Worker

    remote = Worker.from_settings(make_settings(model=str(gpt2_dir), engine_process=True))
    remote.load()
    local = Worker.from_settings(make_settings(model=str(gpt2_dir)))
    local.load()
    yield remote, local
    remote.scheduler.close()


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


@pytest.mark.parametrize("params", REQUESTS, ids=["greedy-logprobs", "n-stop", "echo", "best_of", "constrained"])
def test_answers_equal_the_in_process_engine(workers, params, reference, gpt2_dir):
    """And both against transformers' own model: chosen tokens' logprobs and top logprobs equal a plain forward's,
    greedy picks are its argmax."""
    remote, local = workers
    model, tok = reference(gpt2_dir)
    assert remote.scheduler.process.is_alive() and remote.prefix_cache is None
    prompts = [remote.encode("The capital of France is"), remote.encode("Once upon a time")]
    got, got_timings = remote.complete(prompts, params, 256)
    want, _ = local.complete(prompts, params, 256)
    for ids, a, b in zip(prompts, got, want):
        check_reference(a, model, tok, ids, params, tol=1e-4)
        assert [c.text for c in a.choices] == [c.text for c in b.choices]
        assert [c.finish_reason for c in a.choices] == [c.finish_reason for c in b.choices]
        assert a.completion_tokens == b.completion_tokens and a.prompt_tokens == b.prompt_tokens
        for x, y in zip(a.choices, b.choices):
            if x.logprobs is not None:
                assert x.logprobs.tokens == y.logprobs.tokens
                assert [list(d or {}) for d in x.logprobs.top_logprobs] == [
                    list(d or {}) for d in y.logprobs.top_logprobs
                ]
                for dx, dy in zip(x.logprobs.top_logprobs, y.logprobs.top_logprobs):
                    assert list((dx or {}).values()) == pytest.approx(list((dy or {}).values()), abs=TOL)
                assert x.logprobs.token_logprobs == pytest.approx(y.logprobs.token_logprobs, abs=TOL)
    assert got_timings.prefill_s > 0 and got_timings.generated_tokens == sum(o.completion_tokens for o in got)


def test_a_dropped_stream_stops_the_engine(workers):
    remote, _ = workers
    ids = remote.encode("Hello")
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    from app.engine.params import Timings

    stream = remote.stream([ids], params, 256, Timings())
    for n, _ in enumerate(stream):
        if n == 3:
            break
    stream.close()  # the client went away
    steps = remote.scheduler.steps
    (after,), _ = remote.complete([ids], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), 256)
    assert after.completion_tokens == 2
    assert remote.scheduler.steps - steps < 150  # the dropped request did not run on to 200 tokens


def test_a_dead_engine_fails_waiting_requests(gpt2_dir):
    from app.engine.worker import Worker

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
    worker.scheduler.process.kill()
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
    from app.engine.worker import Worker

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
        worker.scheduler.close()


def test_speculation_in_the_engine_process_answers_as_in_process_and_reports_acceptance(workers, gpt2_dir):
    """SAKER_SPECULATIVE=ngram with the engine in its own process: the answers equal the in-process engine's
    without speculation, the request's timing carries its guesses, and the client sees the engine's counters
    (what /metrics shows)."""
    from app.engine.worker import Worker

    _, local = workers
    settings = make_settings(model=str(gpt2_dir), engine_process=True, speculative="ngram", speculative_ngram_min=1)
    remote = Worker.from_settings(settings)
    remote.load()
    try:
        prompts = [remote.encode("red green blue red green blue red green blue red")]
        params = SamplingParams(max_tokens=30, temperature=0.0, logprobs=1, ignore_eos=True)
        (got,), timings = remote.complete(prompts, params, 256)
        (want,), _ = local.complete(prompts, params, 256)
        assert got.choices[0].text == want.choices[0].text
        assert got.choices[0].logprobs.token_logprobs == pytest.approx(want.choices[0].logprobs.token_logprobs, abs=TOL)
        counts = remote.scheduler.speculation_counts
        assert timings.draft_tokens > 0 and counts["draft_tokens"] == timings.draft_tokens
        assert counts["accepted_tokens"] == timings.accepted_tokens
    finally:
        remote.scheduler.close()
