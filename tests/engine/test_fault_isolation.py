"""No request can wedge the engine: requests at every limit, with failures injected into random steps.

A property test (hypothesis) sends a few requests at once to the scheduler, each shaped at the limits the server
accepts (``n``/``best_of`` up to what the KV budget holds, up to 128; prompts and ``max_tokens`` up to the context;
echo + logprobs, prompt_logprobs, stop strings, seeds, structured outputs; some clients leave early), on engines
whose KV budget is small enough to force preemption, with speculation on and off, and with the runner's fault hook
(``ModelRunner.fault``) failing random forwards and samplings. After each example:

- every request ended: with its answer, or (only where a fault was injected) with ``EngineStepFailed``;
- nothing is held: no block, row, reserved prompt, parked entry, running slot or draft block;
- no leak was repaired behind our back (``EngineCore.repairs`` stays 0) and the state is consistent;
- the next request's greedy text and logprobs equal a plain forward's (transformers' own model, not the engine).

The oracle is independent of the engine: ``references.check_reference`` (one plain forward's log-softmax and its
argmax) for the next request and for every greedy answer that completed.
"""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.engine.core.blocks import BLOCK
from app.engine.errors import ClientGone, EngineStepFailed
from app.engine.core.sequence import RequestGroup
from app.engine.output.decoder import collect
from app.engine.params import Constraint, SamplingParams
from app.engine.core.speculative import SpeculativeConfig
from references import check_reference

CONTEXT = 256  # the tiny models' positions
MAX_N = 128  # the server's default max_n (OpenAI's limit)
ENGINES = {
    # a tight KV budget (64 blocks): two long requests do not fit together, so the newer one is preempted
    "tight-ngram": dict(
        kv_cache_tokens=1024,
        prefix_cache_tokens=256,
        prefill_chunk_tokens=16,
        prefill_batch_tokens=48,
        speculative=SpeculativeConfig("ngram", tokens=3, max_rows=4),
    ),
    # a draft model guessing over a pool of its own (the target itself as its draft), a budget of 80 blocks
    "tight-draft": dict(
        kv_cache_tokens=1280,
        prefix_cache_tokens=128,
        prefill_chunk_tokens=32,
        prefill_batch_tokens=64,
        speculative="draft",
    ),
    # room for n = 128 short candidates; whole prompts, no prefix cache, no speculation
    "wide-plain": dict(kv_cache_tokens=4096, prefix_cache_tokens=0, prefill_chunk_tokens=0, prefill_batch_tokens=512),
}


@pytest.fixture(scope="module", params=sorted(ENGINES))
def engine(request, gpt2_dir, reference):
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.core.worker import Worker

    config = dict(ENGINES[request.param])
    if config.get("speculative") == "draft":
        config["speculative"] = SpeculativeConfig(
            "draft", tokens=3, max_rows=4, draft=lambda: load_model(LoadConfig(model=str(gpt2_dir)))
        )
    worker = Worker.from_loaded(("m",), load_model(LoadConfig(model=str(gpt2_dir))), **config)
    yield worker, reference(gpt2_dir)
    worker.runner.fault = None


class Faults:
    """The runner's fault hook: each forward or sampling fails with probability ``rate`` (draws from ``seed``).
    Before each forward it also checks that the batch's arrays mirror its sequences' block tables and computed
    positions (``BlockBatch.mirror_problem``), and keeps what it found."""

    def __init__(self, seed: int, rate: float, batch=None):
        self.random, self.rate, self.batch = random.Random(seed), rate, batch
        self.injected = 0
        self.mirror_problems: list[str] = []

    def __call__(self, point: str) -> None:
        if self.batch is not None and point in ("rows", "flat"):
            problem = self.batch.mirror_problem()
            if problem is not None:
                self.mirror_problems.append(f"at {point}: {problem}")
        if self.rate and self.random.random() < self.rate:
            self.injected += 1
            raise RuntimeError(f"injected fault at {point}")


@st.composite
def requests(draw, budget: int):
    """One request the server would accept (``completion_service``'s checks: prompt + max_tokens within the
    context, every candidate's reach within the KV budget), shaped toward the limits."""
    prompt_len = draw(st.one_of(st.integers(1, 20), st.integers(1, CONTEXT - 1)))
    max_tokens = draw(st.one_of(st.integers(0, 8), st.integers(0, CONTEXT - prompt_len)))
    reach = prompt_len + max_tokens
    most = max(1, min(MAX_N, budget // (-(-reach // BLOCK) * BLOCK)))
    n = draw(st.one_of(st.just(1), st.just(most), st.integers(1, most)))
    best_of = draw(st.one_of(st.none(), st.integers(n, most)))
    logprobs = draw(st.sampled_from([None, 0, 2]))
    constraint = draw(
        st.sampled_from([None, Constraint("regex", "[a-z ]{0,40}"), Constraint("choice", '["yes", "no", "maybe"]')])
    )
    params = SamplingParams(
        n=n,
        best_of=best_of,
        max_tokens=max_tokens,
        temperature=draw(st.sampled_from([0.0, 0.8])),
        seed=draw(st.one_of(st.none(), st.integers(0, 2**31 - 1))),
        logprobs=logprobs,
        echo=draw(st.booleans()) and logprobs is not None,
        prompt_logprobs=draw(st.sampled_from([None, None, 1])),
        stop=tuple(draw(st.lists(st.sampled_from(["e", "th", " a", "\n"]), max_size=2))),
        ignore_eos=draw(st.booleans()),
        constraint=constraint,
    )
    ids = draw(st.lists(st.integers(1, 380), min_size=prompt_len, max_size=prompt_len))
    leave_after = draw(st.one_of(st.none(), st.integers(0, 6)))  # a client that goes away after that many events
    return ids, params, leave_after


def run(worker, ids, params, leave_after, out: list, index: int) -> None:
    """One request as a request thread runs it: submit, read the ticket's events (leaving early when asked)."""
    group = RequestGroup(worker.runner, ids, params, max_length=CONTEXT)
    try:
        ticket = worker.engine.submit([group], eager=leave_after is not None or bool(params.stop))
        events = []
        try:
            for seen, (_, event) in enumerate(ticket):
                if leave_after is not None and seen >= leave_after:
                    raise ClientGone()
                events.append(event)
        finally:
            ticket.cancel()
        out[index] = ("answer", collect(events, params))
    except ClientGone:
        out[index] = ("left", None)
    except BaseException as exc:  # every outcome is recorded; the test says which are allowed
        out[index] = ("error", exc)


def assert_nothing_held(worker) -> None:
    engine = worker.engine
    assert engine.wait_idle(timeout=120), "the engine did not come back to idle"
    batch = engine.batch
    assert engine.inconsistency() is None, engine.inconsistency()
    assert engine.repairs == 0, "a leak was found (and repaired) at an idle point"
    assert (batch.n, batch.prompts, batch.blocks.held_blocks) == (0, 0, 0)
    assert batch.groups == [] and not engine.scheduler.prefilling and not engine.scheduler.waiting
    assert batch.parked == {}
    assert engine.queue_snapshot()["active"] == 0 and engine.queue_snapshot()["waiting"] == 0
    if batch.speculation is not None:
        assert batch.speculation.proposer.held_blocks() == 0


def next_answer_is_right(worker, ref) -> None:
    """A greedy request after the example: its text and logprobs equal a plain forward's."""
    model, tok = ref
    ids = tok("the quick brown fox")["input_ids"]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)
    [result], _ = worker.complete([ids], params, CONTEXT)
    assert len(result.choices[0].token_ids) == 12
    check_reference(result, model, tok, ids, params)


def test_every_request_ends_and_nothing_stays_held_whatever_fails(engine):
    worker, ref = engine
    engine = worker.engine
    failures, accepted = engine.failures, (engine.speculation_counts or {}).get("accepted_tokens", 0)

    @settings(
        max_examples=30,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(data=st.data())
    def examples(data):
        one_example(worker, ref, data)

    examples()
    # what the examples reached (derandomized: the same every run): failed steps and, with speculation, guesses kept
    assert engine.failures > failures
    if engine.batch.speculation is not None:
        assert engine.speculation_counts["accepted_tokens"] > accepted


def one_example(worker, ref, data) -> None:
    budget = worker.kv_cache_tokens
    batch = data.draw(st.lists(requests(budget), min_size=1, max_size=4), label="requests")
    seed, rate = data.draw(st.integers(0, 2**32 - 1), label="fault seed"), data.draw(st.sampled_from([0.0, 0.1]))
    faults = Faults(seed, rate, worker.engine.batch)
    failures_before = worker.engine.failures
    worker.runner.fault = faults
    outcomes: list = [None] * len(batch)
    try:
        threads = [
            threading.Thread(target=run, args=(worker, ids, params, leave, outcomes, i))
            for i, (ids, params, leave) in enumerate(batch)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert not any(t.is_alive() for t in threads), "a request never ended"
    finally:
        worker.runner.fault = None
    for (ids, params, leave), (kind, value) in zip(batch, outcomes):
        if kind == "error":
            assert isinstance(value, EngineStepFailed) and faults.injected, f"{type(value).__name__}: {value}"
            assert "injected" not in str(value)  # what failed inside is logged, not sent
        elif kind == "answer":
            assert len(value.choices) == params.n
            for choice in value.choices:
                assert choice.finish_reason in ("stop", "length")
            plain = params.temperature == 0.0 and params.constraint is None and not params.stop
            if plain and value.choices[0].token_ids:
                check_reference(value, *ref, ids, params)
        else:
            assert kind == "left" and leave is not None
    assert (worker.engine.failures > failures_before) == (faults.injected > 0)
    assert not faults.mirror_problems, faults.mirror_problems[:3]
    assert_nothing_held(worker)
    next_answer_is_right(worker, ref)
    assert_nothing_held(worker)


def test_the_widest_request_answers_alone_and_beside_others(engine):
    """The wedge of issue 35: ``n = best_of = 128``, ``max_tokens = 1`` (every candidate ends on its first token,
    so the prompt's spare blocks came back after the pool was compacted). Then longer wide requests beside
    narrow ones; every one answers, and the engine holds nothing after."""
    worker, ref = engine
    model, tok = ref
    ids = tok("Hello")["input_ids"]
    budget = worker.kv_cache_tokens
    for max_tokens in (1, 2, 16, 200):
        n = max(1, min(MAX_N, budget // (-(-(len(ids) + max_tokens) // BLOCK) * BLOCK)))
        params = SamplingParams(n=n, best_of=n, max_tokens=max_tokens, temperature=1.0, seed=7, ignore_eos=True)
        narrow = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)
        outcomes: list = [None] * 3
        threads = [
            threading.Thread(target=run, args=(worker, ids, params, None, outcomes, 0)),
            threading.Thread(target=run, args=(worker, ids, narrow, None, outcomes, 1)),
            threading.Thread(target=run, args=(worker, tok("the cat")["input_ids"], narrow, None, outcomes, 2)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert [kind for kind, _ in outcomes] == ["answer"] * 3, outcomes
        assert len(outcomes[0][1].choices) == n
        assert all(len(c.token_ids) == max_tokens for c in outcomes[0][1].choices)
        check_reference(outcomes[1][1], model, tok, ids, narrow)
        assert_nothing_held(worker)
    next_answer_is_right(worker, ref)


def test_a_step_that_fails_fails_only_the_requests_it_touched(engine):
    """A request waiting for its slot while a step fails is served on: only the running ones hear of the failure."""
    worker, ref = engine
    model, tok = ref
    engine = worker.engine
    ids = tok("the quick")["input_ids"]
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    fired = threading.Event()

    def fail_once(point: str) -> None:
        # the first request's first decode step, once the second one waits for the slot it holds
        if point in ("rows", "flat") and engine.batch.groups and not fired.is_set():
            waited = threading.Event()
            while engine.queue_snapshot()["waiting"] < 1 and not waited.wait(0.01):
                pass
            fired.set()
            raise RuntimeError("injected fault in a step")

    before = engine.scheduler.admission.capacity
    engine.scheduler.admission.capacity = 1  # one request runs at a time: the second one waits in the queue
    worker.runner.fault = fail_once
    outcomes: list = [None] * 2
    try:
        first = threading.Thread(target=run, args=(worker, ids, long, None, outcomes, 0))
        first.start()
        while engine.queue_snapshot()["active"] < 1 and not fired.wait(0.01):
            pass  # the first one holds the slot before the second one comes
        second = threading.Thread(target=run, args=(worker, ids, long, None, outcomes, 1))
        second.start()
        first.join(timeout=300)
        second.join(timeout=300)
    finally:
        worker.runner.fault = None
        engine.scheduler.admission.capacity = before
    assert fired.is_set()
    assert outcomes[0][0] == "error" and isinstance(outcomes[0][1], EngineStepFailed)
    assert outcomes[1][0] == "answer", outcomes[1]
    check_reference(outcomes[1][1], model, tok, ids, long)
    assert_nothing_held(worker)


def test_an_engine_that_cannot_be_made_consistent_stops_and_says_so(gpt2_dir):
    """When recovery itself fails, every request fails with a fatal ``EngineStepFailed``, new ones are refused,
    the worker is no longer ready and its ``on_fatal`` is told (the app makes the process exit)."""
    from app.engine.errors import EngineNotReady
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.core.worker import Worker

    worker = Worker.from_loaded(("m",), load_model(LoadConfig(model=str(gpt2_dir))), kv_cache_tokens=1024)
    told = threading.Event()
    worker.on_fatal = lambda reason: told.set()

    def broken(point: str) -> None:
        if point == "sample":  # the prompt's first tokens: a failure of the iteration (``EngineCore._recover``)
            raise RuntimeError("injected fault")

    def no_recovery() -> str:
        return "the test says so"

    worker.runner.fault = broken
    worker.engine.inconsistency = no_recovery
    outcomes: list = [None]
    run(worker, [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0), None, outcomes, 0)
    assert outcomes[0][0] == "error" and isinstance(outcomes[0][1], EngineStepFailed) and outcomes[0][1].fatal
    assert told.wait(30)
    assert not worker.ready and "could not recover" in worker.error
    assert worker.stalled_s() == float("inf")
    with pytest.raises(EngineNotReady):
        worker.require_ready()
    with pytest.raises(EngineNotReady):
        worker.engine.submit([RequestGroup(worker.runner, [5], SamplingParams(max_tokens=1), max_length=CONTEXT)])


@pytest.mark.parametrize("rate", [0.0, 0.05])
def test_preempted_requests_survive_failures_around_them(engine, rate):
    """Long greedy requests that do not fit the KV budget together: the newest gives its blocks back and waits
    with its rows parked, then comes back; with faults injected, whatever answers equals the plain forward, the
    rest fail cleanly, and nothing stays held or parked."""
    worker, ref = engine
    model, tok = ref
    engine = worker.engine
    budget = worker.kv_cache_tokens
    prompts = [tok(text)["input_ids"] for text in ("the quick brown fox", "a cat sat on", "hello there friend")]
    # three requests of two rows each that together need more than the budget: every row grows to 240 positions
    max_tokens = CONTEXT - 16 - max(len(p) for p in prompts)
    need = 2 * -(-(max(len(p) for p in prompts) + max_tokens) // BLOCK) * BLOCK
    if 3 * need <= budget:
        pytest.skip("this engine's budget holds them all")
    params = SamplingParams(n=2, max_tokens=max_tokens, temperature=0.0, logprobs=1, ignore_eos=True)
    before = engine.preemptions
    for seed in range(3 if rate else 1):
        faults = Faults(seed, rate)
        worker.runner.fault = faults
        outcomes: list = [None] * len(prompts)
        threads = [
            threading.Thread(target=run, args=(worker, ids, params, None, outcomes, i)) for i, ids in enumerate(prompts)
        ]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=300)
        finally:
            worker.runner.fault = None
        for ids, (kind, value) in zip(prompts, outcomes):
            if kind == "answer":
                check_reference(value, model, tok, ids, params)
            else:
                assert kind == "error" and isinstance(value, EngineStepFailed) and faults.injected, value
        assert_nothing_held(worker)
    if not rate:
        assert engine.preemptions > before
    next_answer_is_right(worker, ref)
