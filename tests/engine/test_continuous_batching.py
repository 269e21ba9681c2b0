"""Continuous batching keeps fidelity: a request's greedy text and logprobs are the same (within 1e-4 in
float32) whether it ran alone or in a batch with others of different lengths, settings and arrival times."""

from __future__ import annotations

import pytest
import torch

from app.engine.core.sequence import RequestGroup
from app.engine.core.solo import SoloRun
from app.engine.output.decoder import collect
from app.engine.params import SamplingParams
from conftest import make_settings
from references import check_reference, continuation, ref_greedy, ref_logprobs, ref_sampled

TOL = 1e-4


# id(worker) -> (model, tokenizer) loaded by transformers itself: every run alone (``alone``) is checked against it
REFERENCES: dict[int, tuple] = {}


def register(worker, reference, path):
    REFERENCES[id(worker)] = reference(path)
    return worker


@pytest.fixture(scope="module", params=["gpt2", "llama", "gpt2-packed", "llama-packed"])
def batch_worker(request, reference):
    """``-packed``: every linear oneDNN-packed (app/engine/model/optimize.py leaves the tiny models' small matrices
    alone otherwise), so the packed path is checked against the untouched reference too."""
    from app.engine.model import optimize
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.core.worker import Worker

    kind, _, packed = request.param.partition("-")
    path = request.getfixturevalue(f"{kind}_dir")
    settings = make_settings(model=str(path))
    with pytest.MonkeyPatch.context() as patch:
        if packed:
            patch.setattr(optimize, "MIN_PACKED_ELEMENTS", 0)
        loaded = load_model(LoadConfig.of(settings))
    assert any(isinstance(m, optimize.PackedLinear) for m in loaded.model.modules()) == bool(packed)
    worker = Worker.from_loaded(("m",), loaded, max_batch_rows=16)
    return register(worker, reference, path), path


def alone(worker, ids, params):
    """The request run alone (``SoloRun``), checked against the worker's reference model when it has one."""
    result = collect(iter(SoloRun(worker.runner, ids, params, max_length=256)), params)
    if id(worker) in REFERENCES:
        check_reference(result, *REFERENCES[id(worker)], ids, params)
    return result


def batched(worker, requests, late=()):
    """Submit ``requests`` [(ids, params)] together (one scheduler iteration admits them all), then the
    ``late`` ones after the first tokens are out (they join the running batch; or once the first have ended,
    when those end before that many events)."""

    def submit(items, first_tag):
        return worker.engine.submit(
            [
                RequestGroup(worker.runner, ids, params, max_length=256, tag=first_tag + i)
                for i, (ids, params) in enumerate(items)
            ]
        )

    ticket = submit(requests, 0)
    per = {i: [] for i in range(len(requests) + len(late))}
    late_ticket = None
    for seen, (tag, event) in enumerate(ticket, 1):
        per[tag].append(event)
        if seen == 3 * len(requests) and late and late_ticket is None:
            late_ticket = submit(late, len(requests))
    if late and late_ticket is None:
        late_ticket = submit(late, len(requests))
    if late_ticket is not None:
        for tag, event in late_ticket:
            per[tag].append(event)
    params_of = [p for _, p in requests] + [p for _, p in late]
    return [collect(per[i], params_of[i]) for i in range(len(params_of))]


def same(a, b):
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert [c.finish_reason for c in a.choices] == [c.finish_reason for c in b.choices]
    for x, y in zip(a.choices, b.choices):
        if x.logprobs is not None:
            assert x.logprobs.tokens == y.logprobs.tokens
            assert x.logprobs.token_logprobs == pytest.approx(y.logprobs.token_logprobs, abs=TOL)
            for tx, ty in zip(x.logprobs.top_logprobs, y.logprobs.top_logprobs):
                if tx is None or ty is None:
                    assert tx is ty
                    continue
                assert tx.keys() == ty.keys()
                assert list(tx.values()) == pytest.approx(list(ty.values()), abs=TOL)


def test_greedy_requests_of_different_lengths_match_alone(batch_worker, reference, monkeypatch):
    worker, path = batch_worker
    model, tok = reference(path)
    texts = [
        "Hello",
        "Once upon a time there was",
        "The capital of France is Paris. The capital of Italy is",
        "東京 🙂",
        "a",
        "Passage: The bedroom is north of the garden. Question: How do you go",
    ]
    requests = [
        (tok(t).input_ids, SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, logprobs=2, ignore_eos=True))
        for i, t in enumerate(texts)
    ]
    monkeypatch.setattr(worker.engine, "max_rows_seen", 0)  # this test's steps only, not earlier tests'
    results = batched(worker, requests)
    assert worker.engine.max_rows_seen == len(texts)  # every request decoded in the same steps
    for (ids, params), result in zip(requests, results):
        same(result, alone(worker, ids, params))
        # and against a plain forward of the whole sequence
        gen_lps = result.choices[0].logprobs.token_logprobs
        full = ids + result.choices[0].token_ids
        lp = ref_logprobs(model, full)
        expected = [lp[len(ids) + i - 1, t].item() for i, t in enumerate(result.choices[0].token_ids)]
        assert gen_lps == pytest.approx(expected, abs=TOL)


def test_each_candidate_is_a_sequence_whose_numbers_match_the_reference(batch_worker, reference):
    """The engine's plain data per candidate: after a greedy request its ``Sequence`` holds generate()'s tokens,
    the positions its blocks held (the prompt and every token but the last, which no step fed), FINISHED and why;
    a candidate a stop string ended says ``stop``, one the engine ended says its own reason. Sampled candidates'
    tokens are the documented counter-based draws over a plain forward (``references.ref_sampled``), and the answer
    the output side makes of them is that reference's text cut before the stop string."""
    from app.engine.core.sequence import Status

    worker, path = batch_worker
    model, tok = reference(path)
    ids = tok("Once upon a time there was").input_ids
    greedy = RequestGroup(
        worker.runner, ids, SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True), max_length=256
    )
    stopped = RequestGroup(
        worker.runner,
        ids,
        SamplingParams(max_tokens=40, temperature=0.9, seed=3, n=2, stop=("e",), ignore_eos=True),
        max_length=256,
        tag=1,
    )
    assert [s.status for s in greedy.seqs] == [Status.WAITING]
    events = [event for tag, event in worker.engine.submit([greedy, stopped]) if tag == 1]
    [seq] = greedy.seqs
    assert seq.output_ids == ref_greedy(model, tok, ids, 7)[len(ids) :]
    assert seq.num_computed_tokens == len(ids) + 7 - 1
    assert (seq.status, seq.finish_reason) == (Status.FINISHED, "length")
    answer = collect(events, stopped.params)
    for index, seq in enumerate(stopped.seqs):
        want = ref_sampled(model, ids, stopped.params, index, 40, follow=seq.output_ids)
        text = continuation(tok, ids, ids + want)
        assert "e" in text, "the test needs the stop string in each reference answer"
        at = next(k for k in range(1, 41) if "e" in continuation(tok, ids, ids + want[:k]))  # the stop's token
        assert seq.output_ids == want[: len(seq.output_ids)] and len(seq.output_ids) >= at
        # the row leaves when the output side, on the reader's thread, has seen the stop string: unless the engine
        # ended it by its length first (which comes first is the threads' race), its reason is "stop"
        assert seq.status is Status.FINISHED
        assert seq.finish_reason == "stop" if len(seq.output_ids) < 40 else seq.finish_reason in ("stop", "length")
        assert seq.num_computed_tokens == len(ids) + len(seq.output_ids) - 1
        # what the client gets does not depend on that race: the reference text, cut before the stop string
        [choice] = [c for c in answer.choices if c.index == index]
        assert (choice.text, choice.finish_reason) == (text[: text.index("e")], "stop")
    assert greedy.running == [] and stopped.running == []


def test_late_joiners_mixed_settings_and_n(batch_worker, reference):
    worker, path = batch_worker
    _, tok = reference(path)
    first = [
        (
            tok("Once upon a time").input_ids,
            SamplingParams(max_tokens=20, temperature=0.0, logprobs=1, ignore_eos=True),
        ),
        (tok("Hello").input_ids, SamplingParams(max_tokens=12, temperature=0.9, seed=11, n=3, top_k=20)),
        (
            tok("The capital of France is").input_ids,
            SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3, logprobs=0, stop=("e",)),
        ),
    ]
    late = [
        (
            tok("Passage: The bedroom is north of the garden. Question:").input_ids,
            SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, echo=True, ignore_eos=True),
        ),
        (
            tok("x").input_ids,
            SamplingParams(max_tokens=15, temperature=0.7, seed=5, best_of=3, n=2, top_p=0.9, logprobs=0),
        ),
    ]
    results = batched(worker, first, late)
    for (ids, params), result in zip(first + late, results):
        same(result, alone(worker, ids, params))


def test_cancelled_request_leaves_the_others_intact(batch_worker, reference):
    worker, path = batch_worker
    _, tok = reference(path)
    keep_ids = tok("Once upon a time").input_ids
    keep_params = SamplingParams(max_tokens=30, temperature=0.0, logprobs=1, ignore_eos=True)
    doomed = RequestGroup(
        worker.runner,
        tok("Hello there").input_ids,
        SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True),
        max_length=256,
    )
    kept = RequestGroup(worker.runner, keep_ids, keep_params, max_length=256)
    doomed_ticket = worker.engine.submit([doomed])
    kept_ticket = worker.engine.submit([kept])
    for n, _ in enumerate(doomed_ticket):
        if n == 5:
            doomed_ticket.cancel()
    events = [event for _, event in kept_ticket]
    same(collect(events, keep_params), alone(worker, keep_ids, keep_params))
    assert doomed.tokens_made < 200


def test_a_stop_string_ends_its_row_and_nothing_past_it_is_returned(batch_worker, reference):
    """The output side finds the stop string (off the model thread) and ends the candidate: the text stops
    before it, the tokens counted are those up to the one that completed it, and the engine's row leaves within
    a step or two (not at max_tokens), while a longer request in the same batch goes on unaffected."""
    from dataclasses import replace

    worker, path = batch_worker
    _, tok = reference(path)
    ids = tok("Once upon a time").input_ids
    free = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=0)
    plain = alone(worker, ids, free).choices[0]
    pieces = plain.logprobs.tokens
    at = next(i for i in range(3, 30) if pieces[i].strip() and pieces[i] not in "".join(pieces[:i]))
    stop = pieces[at]
    stopped = replace(free, stop=(stop,))
    other_ids = tok("Hello").input_ids
    other = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, logprobs=0)
    group = RequestGroup(worker.runner, ids, stopped, max_length=256, tag=0)
    ticket = worker.engine.submit([group, RequestGroup(worker.runner, other_ids, other, max_length=256, tag=1)])
    per = {0: [], 1: []}
    for tag, event in ticket:
        per[tag].append(event)
    out = collect(per[0], stopped)
    assert out.choices[0].text == "".join(pieces[:at])
    assert out.choices[0].finish_reason == "stop"
    assert out.completion_tokens == at + 1  # up to the token that completed the stop
    assert at + 1 <= group.tokens_made <= at + 3  # the row left a step or two later, not at 40
    same(collect(per[1], other), alone(worker, other_ids, other))


def test_a_small_request_does_not_wait_for_a_large_one(gpt2_dir, reference):
    """A request with more candidates than max_batch_rows runs alone at first; a small one that comes later
    joins beside it (up to max_batch_rows rows of its own) and ends long before it. Both equal their runs alone."""
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.core.worker import Worker

    worker = register(
        Worker.from_loaded(("m",), load_model(LoadConfig(model=str(gpt2_dir))), max_batch_rows=4),
        reference,
        gpt2_dir,
    )
    _, tok = reference(gpt2_dir)
    big_ids, small_ids = tok("Once upon a time").input_ids, tok("Hello").input_ids
    big_params = SamplingParams(max_tokens=40, temperature=0.8, seed=4, n=6, ignore_eos=True)
    small_params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    big = RequestGroup(worker.runner, big_ids, big_params, max_length=256)
    big_ticket = worker.engine.submit([big])
    big_events = iter(big_ticket)
    first = [next(big_events) for _ in range(7)]  # the prompt and the first tokens: it is running
    small = worker.engine.submit([RequestGroup(worker.runner, small_ids, small_params, max_length=256)])
    small_events = [event for _, event in small]
    assert big.tokens_made < 6 * 40  # the small one ended while the big one ran
    assert worker.engine.max_rows_seen == 7
    same(collect(small_events, small_params), alone(worker, small_ids, small_params))
    same(collect([e for _, e in first] + [e for _, e in big_events], big_params), alone(worker, big_ids, big_params))


def test_batch_size_one_serves_one_at_a_time(gpt2_dir, reference):
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.core.worker import Worker

    worker = register(
        Worker.from_loaded(("m",), load_model(LoadConfig(model=str(gpt2_dir))), max_batch_rows=1),
        reference,
        gpt2_dir,
    )
    _, tok = reference(gpt2_dir)
    requests = [(tok(t).input_ids, SamplingParams(max_tokens=6, temperature=0.0)) for t in ("Hello", "Once upon")]
    results = batched(worker, requests)
    assert worker.engine.max_rows_seen == 1
    for (ids, params), result in zip(requests, results):
        same(result, alone(worker, ids, params))


@pytest.fixture()
def one_slot(gpt2_dir, reference, monkeypatch):
    """A worker that runs one request at a time (``max_running_requests=1``) with one waiting place and a queue
    timeout, and a gate that holds the scheduler inside its steps: ``(worker, gate)``; ``gate.hold()`` makes the
    next step wait until ``gate.go()``."""
    import threading

    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.core.worker import Worker

    worker = Worker.from_loaded(
        ("m",),
        load_model(LoadConfig(model=str(gpt2_dir))),
        max_batch_rows=8,
        max_running_requests=1,
        max_queue=1,
        queue_timeout=60,
    )
    register(worker, reference, gpt2_dir)

    class Gate:
        def __init__(self):
            self.held, self.release = threading.Event(), threading.Event()
            self.release.set()

        def hold(self):
            self.held.clear()
            self.release.clear()

        def go(self):
            self.release.set()

    gate = Gate()
    real = worker.runner.flat_step

    def gated(*args, **kwargs):
        out = real(*args, **kwargs)
        if not gate.release.is_set():
            gate.held.set()
            gate.release.wait(30)
        return out

    monkeypatch.setattr(worker.runner, "flat_step", gated)
    return worker, gate


def test_the_one_queue_runs_requests_in_order_within_the_running_limit(one_slot, reference, gpt2_dir):
    """max_running_requests=1: the second request waits in the scheduler's queue (its prompt not even started) while
    the first runs; a third finds the one waiting place taken (QueueFull at once, nothing queued); when the first
    ends the second runs, and both answers equal their reference."""
    from app.engine.errors import QueueFull

    worker, gate = one_slot
    _, tok = reference(gpt2_dir)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    first_ids, second_ids = tok("Hello there").input_ids, tok("Once upon a time").input_ids
    gate.hold()
    first = worker.engine.submit([RequestGroup(worker.runner, first_ids, params, max_length=256)])
    assert gate.held.wait(10)  # the first is in a step
    second_group = RequestGroup(worker.runner, second_ids, params, max_length=256)
    second = worker.engine.submit([second_group])
    assert worker.queue_snapshot() == {"active": 1, "waiting": 1, "rejected": 0, "timed_out": 0}
    with pytest.raises(QueueFull) as info:
        worker.engine.submit([RequestGroup(worker.runner, second_ids, params, max_length=256)])
    assert (info.value.waiting, info.value.limit) == (1, 1)
    assert worker.engine.open_requests == 2  # the refused one left nothing behind
    gate.go()
    first_result = collect([e for _, e in first], params)
    assert second_group.timings.queue_s > 0  # it waited for the first one's slot
    second_result = collect([e for _, e in second], params)
    same(first_result, alone(worker, first_ids, params))
    same(second_result, alone(worker, second_ids, params))
    assert worker.queue_snapshot() == {"active": 0, "waiting": 0, "rejected": 1, "timed_out": 0}


def test_a_waiting_request_that_is_cancelled_or_times_out_leaves_the_queue(one_slot, reference, gpt2_dir):
    """Requests waiting for the running slot: one cancelled ends with no events, one past the queue timeout fails
    with QueueTimeout, both at the scheduler's next iteration (the running request has tokens to go); the running
    request's answer is unchanged and nothing is held afterwards."""
    from app.engine.errors import QueueTimeout

    worker, gate = one_slot
    _, tok = reference(gpt2_dir)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ids = tok("Hello there").input_ids
    worker.engine.scheduler.admission.max_queue = 2
    gate.hold()
    running = worker.engine.submit([RequestGroup(worker.runner, ids, params, max_length=256)])
    assert gate.held.wait(10)
    doomed = worker.engine.submit([RequestGroup(worker.runner, ids, params, max_length=256)])
    late = worker.engine.submit([RequestGroup(worker.runner, ids, params, max_length=256)])
    assert worker.queue_snapshot()["waiting"] == 2
    doomed.cancel()
    with worker.engine._cond:  # the late one's deadline passes (the clock is not waited on)
        worker.engine.scheduler.admission._waiting[late.rid] -= 120
    gate.go()  # the next iteration, before the running request's next token, takes both out of the queue
    assert list(doomed) == []
    with pytest.raises(QueueTimeout) as info:
        list(late)
    assert info.value.limit_s == 60 and info.value.waited_s >= 120
    same(collect([e for _, e in running], params), alone(worker, ids, params))
    assert worker.queue_snapshot() == {"active": 0, "waiting": 0, "rejected": 0, "timed_out": 1}
    assert worker.engine.open_requests == 0 and worker.engine.kv_usage == 0.0


def matches_generate(result, model, tok, ids, max_new):
    """A greedy answer with logprobs equals ``generate()``'s tokens and a plain forward's log-softmax."""
    want = ref_greedy(model, tok, ids, max_new)
    [choice] = result.choices
    assert choice.text == continuation(tok, ids, want)
    lp = ref_logprobs(model, want)
    expected = [float(lp[len(ids) - 1 + i, t]) for i, t in enumerate(want[len(ids) :])]
    assert choice.logprobs.token_logprobs == pytest.approx(expected, abs=TOL)


def test_when_blocks_run_out_the_newest_request_gives_them_back_and_every_answer_is_unchanged(gpt2_dir, reference):
    """A KV budget of 10 blocks and three requests that each grow to 4-5 blocks per row (one with n=2): they are
    admitted for what they hold now, and when the rows cross into more blocks than are free the newest request gives
    its blocks back, waits, and is computed again. Greedy answers equal ``generate()`` and a plain forward's
    logprobs; the seeded sampled one equals its run alone; nothing is held afterwards."""
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.core.worker import Worker

    worker = Worker.from_loaded(
        ("m",), load_model(LoadConfig(model=str(gpt2_dir))), max_batch_rows=8, kv_cache_tokens=160
    )
    model, tok = reference(gpt2_dir)
    ids = tok("Once upon a time").input_ids
    other = tok("The weather today").input_ids
    greedy = SamplingParams(max_tokens=70 - len(ids), temperature=0.0, ignore_eos=True, logprobs=1)
    sampled = SamplingParams(
        max_tokens=70 - len(other), temperature=1.0, seed=11, n=2, ignore_eos=True, logprobs=1, presence_penalty=0.5
    )
    results = batched(worker, [(ids, greedy), (other, sampled), (ids, greedy)])
    assert worker.engine.preemptions > 0
    matches_generate(results[0], model, tok, ids, greedy.max_tokens)
    matches_generate(results[2], model, tok, ids, greedy.max_tokens)
    same(results[1], alone(worker, other, sampled))
    assert worker.engine.kv_usage == 0.0


def test_a_request_that_fits_the_budget_alone_is_never_held_back_by_newer_ones(gpt2_dir, reference):
    """The oldest request keeps its blocks: a request as long as the whole budget (5 blocks) runs to its end beside
    newer ones that are admitted for what they hold and give their blocks back when it needs them; every answer
    equals ``generate()``. (Submitted together, so that the steps do not depend on thread timing.)"""
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.core.worker import Worker

    worker = Worker.from_loaded(
        ("m",), load_model(LoadConfig(model=str(gpt2_dir))), max_batch_rows=8, kv_cache_tokens=80
    )
    model, tok = reference(gpt2_dir)
    ids = tok("Once upon a time").input_ids
    long = SamplingParams(max_tokens=80 - len(ids), temperature=0.0, ignore_eos=True, logprobs=1)
    short = SamplingParams(max_tokens=36, temperature=0.0, ignore_eos=True, logprobs=1)
    results = batched(worker, [(ids, long), (ids, short), (ids, short)])
    matches_generate(results[0], model, tok, ids, long.max_tokens)
    for result in results[1:]:
        matches_generate(result, model, tok, ids, short.max_tokens)
    assert worker.engine.preemptions > 0
    assert worker.engine.kv_usage == 0.0


def test_a_preempted_request_cancelled_while_it_waits_leaves_nothing_behind(gpt2_dir, reference, monkeypatch):
    """The newest request gives its blocks back (its rows' state parked in the batch) and its client goes away
    before it comes back: it ends without an error, nothing stays parked or held, and the request that kept its
    blocks equals ``generate()``."""
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.core.worker import Worker

    worker = Worker.from_loaded(
        ("m",), load_model(LoadConfig(model=str(gpt2_dir))), max_batch_rows=8, kv_cache_tokens=80
    )
    model, tok = reference(gpt2_dir)
    ids = tok("Once upon a time").input_ids
    long = SamplingParams(max_tokens=80 - len(ids), temperature=0.0, ignore_eos=True, logprobs=1)
    short = SamplingParams(max_tokens=36, temperature=0.0, ignore_eos=True)
    engine = worker.engine
    real = engine.scheduler._make_room
    cancelled = []

    def make_room():  # on the model thread: the first preempted request's client goes away at once
        preempted = real()
        if engine.preemptions and not cancelled:
            waiting = engine.scheduler.waiting[0]
            assert waiting.preempted and engine.batch.parked
            cancelled.append(waiting)
            engine.abort(waiting.request_id)
        return preempted

    monkeypatch.setattr(engine.scheduler, "_make_room", make_room)
    first = engine.submit([RequestGroup(worker.runner, ids, long, max_length=256)])
    second = engine.submit([RequestGroup(worker.runner, ids, short, max_length=256)])
    long_result = collect([e for _, e in first], long)
    list(second)  # ends (cut short), no error
    assert cancelled and cancelled[0].status.value == "finished"
    matches_generate(long_result, model, tok, ids, long.max_tokens)
    assert engine.batch.parked == {} and engine.kv_usage == 0.0 and engine.open_requests == 0


def test_a_request_that_could_never_fit_the_kv_budget_is_a_400(gpt2_dir):
    """n x (prompt + max_tokens), in whole 16-position blocks, beyond the KV budget: a 400 naming n before anything
    runs; within it: served."""
    from app import create_app
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.core.worker import Worker

    settings = make_settings(model=str(gpt2_dir), served_model_name="tiny-gpt2")
    worker = Worker.from_loaded(
        ("tiny-gpt2",), load_model(LoadConfig.of(settings)), max_batch_rows=8, kv_cache_tokens=100
    )
    client = create_app(settings, worker=worker).test_client()
    body = {"model": "tiny-gpt2", "prompt": [5, 6, 7, 8], "max_tokens": 30, "temperature": 0.5, "seed": 1}
    too_many = client.post("/v1/completions", json={**body, "n": 4})
    assert too_many.status_code == 400
    error = too_many.get_json()["error"]
    assert error["param"] == "n" and "KV" in error["message"] and "192" in error["message"]  # 4 x 3 blocks
    long = client.post("/v1/completions", json={**body, "max_tokens": 120})
    assert long.status_code == 400 and long.get_json()["error"]["param"] == "max_tokens"
    ok = client.post("/v1/completions", json={**body, "n": 2})  # 2 x 34 positions: 2 x 3 blocks = 96 positions
    assert ok.status_code == 200 and len(ok.get_json()["choices"]) == 2


class InjectedOOM:
    """CUDA's out-of-memory error raised in the second layer's attention of decode steps of at least ``rows`` rows,
    ``times`` times (None: always): after the first layer has already written its keys and values to the pool. It
    wraps ``attention.flat_attention``, which every forward's attention goes through (transformers' modules and
    ``fused_forward`` alike)."""

    def __init__(self, rows: int, times: int | None):
        from app.engine.model import attention

        self.rows, self.times, self.raised = rows, times, 0
        self.module, self.real = attention, attention.flat_attention
        attention.flat_attention = self

    def __call__(self, module, query, key, value, flat, *args, **kwargs):
        decode = not flat.chunks and flat.rows >= self.rows
        if module.layer_idx == 1 and decode and (self.times is None or self.raised < self.times):
            self.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return self.real(module, query, key, value, flat, *args, **kwargs)

    def remove(self) -> None:
        self.module.flat_attention = self.real


def run_tickets(worker, requests):
    """Submit each request as its own ticket, back to back; per request its result or the exception it got."""
    groups = [RequestGroup(worker.runner, ids, params, max_length=256) for ids, params in requests]
    tickets = [worker.engine.submit([g]) for g in groups]
    out = []
    for (_, params), ticket in zip(requests, tickets):
        try:
            out.append(collect([event for _, event in ticket], params))
        except Exception as exc:
            out.append(exc)
    return out


@pytest.mark.parametrize("times", [1, None])
def test_out_of_memory_in_a_step_fails_the_newest_request_only(batch_worker, reference, times):
    """One OOM in a 3-row step fails the newest request; the others are rewound and go on with the numbers
    they get alone. With OOMs at every multi-row step, requests fail newest first until one is left."""

    worker, path = batch_worker
    _, tok = reference(path)
    requests = [
        (tok(text).input_ids, SamplingParams(max_tokens=20, temperature=0.0, logprobs=2, ignore_eos=True))
        for text in ("Once upon a time there was", "Hello", "The capital of France is")
    ]
    expected = [alone(worker, ids, params) for ids, params in requests]
    inject = InjectedOOM(rows=3 if times == 1 else 2, times=times)
    try:
        results = run_tickets(worker, requests)
    finally:
        inject.remove()
    assert inject.raised == (1 if times == 1 else 2)
    survivors = 2 if times == 1 else 1
    for result, want in zip(results[:survivors], expected):
        same(result, want)
    for result in results[survivors:]:
        assert isinstance(result, torch.OutOfMemoryError)
    assert worker.engine.batch.groups == []
    same(run_tickets(worker, requests[-1:])[0], expected[-1])  # the server goes on


@pytest.fixture()
def shared_prefill(batch_worker, monkeypatch):
    """The batch worker with a step budget of 4096 prompt tokens; records the prompt chunks of each flat step."""
    worker, path = batch_worker
    calls = []
    real = worker.runner.flat_step

    def recording(tokens, positions, flat, logits_at):
        calls.append([count for *_, count in flat.chunks])
        return real(tokens, positions, flat, logits_at)

    monkeypatch.setattr(worker.runner, "flat_step", recording)
    monkeypatch.setattr(worker.engine.scheduler, "prefill_tokens", 4096)
    return worker, path, calls


def test_prompts_prefilled_together_match_alone(shared_prefill, reference):
    """Prompts of different lengths and settings admitted together are computed in one flat forward (no
    padding: each attends over its own slot); each request's text, logprobs (echoed prompt included) and seeded
    samples are those it gets alone."""
    worker, path, calls = shared_prefill
    _, tok = reference(path)
    requests = [
        (
            tok("Once upon a time there").input_ids,
            SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True),
        ),
        (tok("The capital of France").input_ids, SamplingParams(max_tokens=0, echo=True, logprobs=3)),
        (
            tok("Hello world, this is").input_ids,
            SamplingParams(max_tokens=8, temperature=0.8, seed=3, n=2, logprobs=0, ignore_eos=True),
        ),
        (
            tok("def add(a, b):").input_ids,
            SamplingParams(max_tokens=6, temperature=0.0, echo=True, logprobs=1, ignore_eos=True),
        ),
        (tok("東京 🙂 x").input_ids, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)),
    ]
    lengths = [len(ids) for ids, _ in requests]
    assert len(set(lengths)) > 1, lengths
    results = batched(worker, requests)
    assert calls and max(len(c) for c in calls) >= 3, calls
    assert sum(len(c) for c in calls) == len(requests)  # each prompt in one chunk, once
    for (ids, params), result in zip(requests, results):
        same(result, alone(worker, ids, params))


def test_the_step_budget_bounds_the_prompt_tokens_of_a_forward(shared_prefill, reference, monkeypatch):
    """With a budget of 12 tokens per step, prompts admitted together are spread over steps (one is cut
    between two), and each still answers as alone."""
    worker, path, calls = shared_prefill
    monkeypatch.setattr(worker.engine.scheduler, "prefill_tokens", 12)
    monkeypatch.setattr(worker.engine.scheduler, "prefill_chunk_tokens", 12)
    _, tok = reference(path)
    text = tok(
        "Passage: The bedroom is north of the garden. Question: How do you go from the bathroom to the "
        "office? Answer: east east"
    ).input_ids
    requests = [(ids, SamplingParams(max_tokens=3, temperature=0.0)) for ids in (text[:6], text[3:9], text[5:10])]
    results = batched(worker, requests)
    assert calls[0] == [6, 6] and all(sum(c) <= 12 for c in calls), calls
    assert sum(sum(c) for c in calls) == 6 + 6 + 5
    for (ids, params), result in zip(requests, results):
        same(result, alone(worker, ids, params))


def test_failed_shared_prefill_falls_back_to_one_at_a_time(shared_prefill, reference, monkeypatch):
    worker, path, calls = shared_prefill
    _, tok = reference(path)
    real = worker.runner.flat_step

    def out_of_memory(tokens, positions, flat, logits_at):  # the fixture's recorder records the forwards that run
        if len(flat.chunks) > 1:
            calls.append([count for *_, count in flat.chunks])
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB (injected)")
        return real(tokens, positions, flat, logits_at)

    monkeypatch.setattr(worker.runner, "flat_step", out_of_memory)
    text = tok("Once upon a time there was a garden north of the office").input_ids
    requests = [
        (ids, SamplingParams(max_tokens=4, temperature=0.0, logprobs=1)) for ids in (text[:6], text[2:8], text[4:9])
    ]
    results = batched(worker, requests)
    assert calls[:4] == [[6, 6, 5], [6], [6], [5]]
    for (ids, params), result in zip(requests, results):
        same(result, alone(worker, ids, params))


def test_a_prompt_scored_beside_another_leaves_nothing_in_its_slot(shared_prefill, reference):
    """The shorter prompt decodes alone after the other only scored its prompt in the same forward: its slot
    holds its own positions only."""
    worker, path, calls = shared_prefill
    _, tok = reference(path)
    text = tok("Once upon a time there was a garden north of the office").input_ids
    requests = [
        (text[:6], SamplingParams(max_tokens=10, temperature=0.0, logprobs=1, ignore_eos=True)),
        (text[:8], SamplingParams(max_tokens=0, echo=True, logprobs=2)),
    ]
    results = batched(worker, requests)
    assert calls[0] == [6, 8]
    for (ids, params), result in zip(requests, results):
        same(result, alone(worker, ids, params))


@pytest.mark.parametrize("seed", range(4))
def test_random_mixes_of_shared_prefixes_settings_and_arrivals_match_alone(seed, gpt2_dir, llama_dir, reference):
    """Property check of the admission paths together: prompts that share random prefixes (prefix cache hits),
    arrive together (shared prefills) or late (joining a running batch), are long (chunked prefill), with mixed
    settings, all give what they give one at a time on a worker with all of these off."""
    import random

    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.core.worker import Worker

    rng = random.Random(seed)
    path = gpt2_dir if seed % 2 == 0 else llama_dir
    _, tok = reference(path)
    settings = make_settings(model=str(path))
    fast = Worker.from_loaded(
        ("m",),
        load_model(LoadConfig.of(settings)),
        max_batch_rows=16,
        prefix_cache_tokens=2048,
        prefill_batch_tokens=4096,
        prefill_chunk_tokens=rng.choice([7, 16, 512]),
    )
    plain = Worker.from_loaded(
        ("m",),
        load_model(LoadConfig.of(settings)),
        max_batch_rows=1,
        prefix_cache_tokens=0,
        prefill_batch_tokens=0,
        prefill_chunk_tokens=0,
    )
    base = tok(
        "Passage: The bedroom is north of the garden. The bathroom is west of the garden. Question: How "
        "do you go from the bathroom to the office? Answer: east east"
    ).input_ids
    vocab = len(tok)

    def prompt():
        keep = rng.choice([0, 17, 20, len(base) - 3, len(base)])
        return base[:keep] + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 12))]

    def params():
        kind = rng.choice(["greedy", "seeded", "echo", "score"])
        if kind == "greedy":
            return SamplingParams(
                max_tokens=rng.randint(1, 10), temperature=0.0, logprobs=rng.choice([None, 0, 2]), ignore_eos=True
            )
        if kind == "seeded":
            return SamplingParams(
                max_tokens=rng.randint(1, 8),
                temperature=0.8,
                seed=rng.randrange(100),
                n=rng.choice([1, 2]),
                logprobs=1,
                ignore_eos=True,
            )
        if kind == "echo":
            return SamplingParams(max_tokens=rng.randint(1, 5), temperature=0.0, echo=True, logprobs=1, ignore_eos=True)
        return SamplingParams(max_tokens=0, echo=True, logprobs=2)

    greedy = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1, ignore_eos=True)
    warm = [(base + [5, 6], greedy)] + [(prompt(), params()) for _ in range(2)]  # fill the prefix cache
    first = [(base[:20] + [7], greedy)] + [(prompt(), params()) for _ in range(rng.randint(1, 4))]
    rng.shuffle(first)
    late = [(prompt(), params()) for _ in range(rng.randint(0, 3))]
    batched(fast, warm)
    hits = fast.prefix_cache.hits
    results = batched(fast, first, late)
    assert fast.prefix_cache.hits > hits
    model, _ = reference(path)
    for (ids, p), result in zip(first + late, results):
        same(result, batched(plain, [(ids, p)])[0])
        check_reference(result, model, tok, ids, p)


@pytest.fixture()
def chunked(batch_worker, monkeypatch):
    """The batch worker prefilling prompts longer than 5 tokens 5 at a time; logs its forwards in order."""
    worker, path = batch_worker
    calls = []
    real_flat, real_decode = worker.runner.flat_step, worker.runner.rows_step

    def flat_step(
        tokens, positions, flat, logits_at
    ):  # a chunk, and the running rows' decode tokens when they ride along
        if flat.rows:
            calls.append(("decode", flat.rows))
        calls.extend(("chunk", count) for *_, count in flat.chunks)
        return real_flat(tokens, positions, flat, logits_at)

    def decode(*args, **kwargs):
        calls.append(("decode", args[0].shape[0]))
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(worker.runner, "flat_step", flat_step)
    monkeypatch.setattr(worker.runner, "rows_step", decode)
    monkeypatch.setattr(worker.engine.scheduler, "prefill_chunk_tokens", 5)
    if worker.prefix_cache is not None:
        worker.prefix_cache.clear_cached()  # a kept prompt would leave too little to chunk
    return worker, path, calls


def long_ids(tok):
    return tok(
        "Passage: The bedroom is north of the garden. The bathroom is west of the garden. Question: How do "
        "you go from the bathroom to the office? Answer: east east"
    ).input_ids


def test_chunked_prefill_matches_a_whole_prefill(chunked, reference):
    """Long prompts prefilled 5 tokens per iteration give what one prefill gives: text, logprobs, echo scores
    of every prompt position, seeded samples."""
    worker, path, calls = chunked
    _, tok = reference(path)
    ids = long_ids(tok)
    requests = [
        (ids, SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)),
        (ids[3:] + ids[:4], SamplingParams(max_tokens=3, temperature=0.0, echo=True, logprobs=1, ignore_eos=True)),
        (ids[::-1], SamplingParams(max_tokens=6, temperature=0.9, seed=4, n=2, logprobs=0, ignore_eos=True)),
        (ids[:4], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)),  # short: not chunked
    ]
    results = batched(worker, requests)
    assert sum(1 for kind, _ in calls if kind == "chunk") >= 3 * (len(ids) // 5)
    assert all(n <= 5 for kind, n in calls if kind == "chunk")
    for (prompt, params), result in zip(requests, results):
        same(result, alone(worker, prompt, params))


def test_running_requests_decode_between_the_chunks_of_a_long_prompt(chunked, reference):
    worker, path, calls = chunked
    _, tok = reference(path)
    ids = long_ids(tok)
    running = (ids[:4], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    late = (ids[7:] + ids[:7], SamplingParams(max_tokens=4, temperature=0.0, logprobs=1, ignore_eos=True))
    results = batched(worker, [running], [late])
    chunk_at = [i for i, (kind, _) in enumerate(calls) if kind == "chunk"]
    assert len(chunk_at) >= len(ids) // 5
    between = [kind for kind, _ in calls[chunk_at[0] : chunk_at[-1]]]
    assert between.count("decode") >= len(chunk_at) - 1  # a decode step after every chunk
    for (prompt, params), result in zip([running, late], results):
        same(result, alone(worker, prompt, params))


def test_a_failed_chunk_fails_only_its_request(chunked, reference, monkeypatch):
    worker, path, calls = chunked
    _, tok = reference(path)
    ids = long_ids(tok)
    real = worker.runner.flat_step
    seen = {"n": 0}

    def failing(tokens, positions, flat, logits_at):
        seen["n"] += 1
        if seen["n"] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(tokens, positions, flat, logits_at)

    monkeypatch.setattr(worker.runner, "flat_step", failing)
    short = (ids[:4], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    results = run_tickets(worker, [short, (ids[11:] + ids[:11], SamplingParams(max_tokens=4, temperature=0.0))])
    same(results[0], alone(worker, *short))
    assert isinstance(results[1], torch.OutOfMemoryError)
    assert not worker.engine.scheduler.prefilling and worker.engine.batch.groups == []


def test_a_request_cancelled_during_its_chunked_prefill_leaves(chunked, reference, monkeypatch):
    import threading

    worker, path, calls = chunked
    _, tok = reference(path)
    ids = long_ids(tok)
    started, go = threading.Event(), threading.Event()
    logged_flat = worker.runner.flat_step

    def gated(tokens, positions, flat, logits_at):  # hold the scheduler after the doomed prompt's first chunk
        out = logged_flat(tokens, positions, flat, logits_at)
        if any(count == 5 for *_, count in flat.chunks) and not started.is_set():
            started.set()
            go.wait(10)
        return out

    monkeypatch.setattr(worker.runner, "flat_step", gated)
    running = RequestGroup(
        worker.runner, ids[:4], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), max_length=256
    )
    doomed = RequestGroup(
        worker.runner, ids[5:] + ids[:5], SamplingParams(max_tokens=4, temperature=0.0), max_length=256
    )
    running_ticket = worker.engine.submit([running])
    _, first = next(iter(running_ticket))  # it is decoding
    doomed_ticket = worker.engine.submit([doomed])
    assert started.wait(10)  # its chunked prefill has started
    doomed_ticket.cancel()
    go.set()
    assert list(doomed_ticket) == []  # it ends without a token
    events = [first] + [event for _, event in running_ticket]
    same(collect(events, running.params), alone(worker, ids[:4], running.params))
    assert not worker.engine.scheduler.prefilling
    assert sum(1 for kind, n in calls if kind == "chunk" and n == 5) == 1


def test_a_cancelled_request_waiting_for_its_chunks_leaves_at_once(chunked, reference, monkeypatch):
    """Beside another long prompt, a cancelled one is dropped at the next step, before its prompt is in."""
    import threading

    worker, path, calls = chunked
    _, tok = reference(path)
    ids = long_ids(tok)
    held = [threading.Event(), threading.Event()]  # set when the scheduler is held at the first two chunks
    release = [threading.Event(), threading.Event()]
    logged_flat = worker.runner.flat_step

    steps = []

    def gated(tokens, positions, flat, logits_at):
        out = logged_flat(tokens, positions, flat, logits_at)
        steps.append(len(flat.chunks))
        if len(steps) <= 2:
            held[len(steps) - 1].set()
            release[len(steps) - 1].wait(10)
        return out

    monkeypatch.setattr(worker.runner, "flat_step", gated)
    forgotten_at = {}
    real_end = worker.engine.scheduler.end

    def end(group, error=None):
        forgotten_at[id(group)] = len(steps)
        return real_end(group, error)

    monkeypatch.setattr(worker.engine.scheduler, "end", end)
    first_prompt, second_prompt = ids[9:] + ids[:9], ids[13:] + ids[:13]
    params = SamplingParams(max_tokens=3, temperature=0.0)
    first = worker.engine.submit([RequestGroup(worker.runner, first_prompt, params, max_length=256)])
    assert held[0].wait(10)  # held in the first one's first chunk
    doomed = RequestGroup(worker.runner, second_prompt, params, max_length=256)
    second = worker.engine.submit([doomed])
    release[0].set()
    assert held[1].wait(10)  # the second step: both prompts' chunks
    assert steps == [1, 2] and any(job.group is doomed for job in worker.engine.scheduler.prefilling)
    second.cancel()
    release[1].set()
    assert list(second) == []
    assert forgotten_at[id(doomed)] == 2  # dropped before the third step
    events = [event for _, event in first]
    same(collect(events, params), alone(worker, first_prompt, params))
    assert not worker.engine.scheduler.prefilling
