"""Prompt KV reuse: the cache's bookkeeping without a model, then requests that reuse a kept prefix against a
plain forward of the whole sequence and against the same worker with the cache off."""

from __future__ import annotations

import pytest
import torch

from app.engine.generate import SoloRun
from app.engine.output import collect
from app.engine.params import SamplingParams
from app.engine.prefix_cache import MIN_REUSE, PrefixCache
from references import ref_greedy, ref_logprobs

TOL = 1e-4


class FakeLayer:
    def __init__(self, length: int, fill: float = 0.0):
        self.keys = torch.full((2, 3, length + 4, 5), fill)  # rows and spare columns beyond the prompt
        self.values = torch.full((2, 3, length + 4, 7), fill)


def layers(length, fill=0.0):
    return [FakeLayer(length, fill), FakeLayer(length, fill)]


def test_lookup_takes_the_longest_common_prefix_and_keeps_one_token_to_compute():
    cache = PrefixCache(max_tokens=1000)
    a, b = list(range(40)), list(range(20)) + [99] * 20
    cache.store("", a, layers(40, 1.0))
    cache.store("", b, layers(40, 2.0))
    entry, n = cache.lookup("", list(range(30)) + [7])
    assert n == 30 and entry.tokens == tuple(a)
    assert entry.keys[0].shape == (1, 3, 40, 5) and entry.values[1].shape == (1, 3, 40, 7)
    assert float(entry.keys[0][0, 0, 0, 0]) == 1.0
    assert cache.lookup("", a)[1] == 39  # the same prompt: its last token is computed
    assert cache.lookup("", list(range(MIN_REUSE - 1)) + [5, 5])[1] == 0  # too short a match
    assert cache.lookup("other-adapter", a) == (None, 0)  # keys are per adapter
    assert cache.hits == 2 and cache.reused_tokens == 69


def test_stored_copies_do_not_follow_the_layers():
    cache = PrefixCache(max_tokens=1000)
    source = layers(20, 1.0)
    cache.store("", list(range(20)), source)
    source[0].keys.fill_(5.0)
    entry, _ = cache.lookup("", list(range(21)))
    assert float(entry.keys[0].max()) == 1.0


def test_budget_drops_least_recently_used_and_extensions_replace():
    cache = PrefixCache(max_tokens=60)
    first, second = list(range(100, 120)), list(range(200, 220))
    cache.store("", first, layers(20))
    cache.store("", second, layers(20))
    cache.lookup("", first + [1])  # first is used: second is now the oldest
    cache.store("", list(range(300, 330)), layers(30))
    assert cache.tokens == 50 and len(cache) == 2
    assert cache.lookup("", second + [1]) == (None, 0)
    cache.store("", first + list(range(10)), layers(30))  # extends first: replaces it
    assert len(cache) == 2 and cache.tokens == 60
    assert cache.lookup("", first + list(range(10)) + [1])[1] == 30
    cache.store("", list(range(70)), layers(70))  # longer than the whole budget: not kept
    assert cache.tokens == 60 and len(cache) == 2
    cache.store("", list(range(MIN_REUSE - 1)), layers(MIN_REUSE - 1))  # too short to be worth keeping
    assert len(cache) == 2


# -- with a model --------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["gpt2", "llama"])
def workers(request):
    """The same model twice: prefix cache on and off."""
    from app.engine.loader import load_model
    from app.engine.worker import Worker
    from conftest import make_settings

    path = request.getfixturevalue(f"{request.param}_dir")
    loaded = load_model(make_settings(model=str(path)))
    on = Worker.from_loaded(("m",), loaded, prefix_cache_tokens=4096)
    off = Worker.from_loaded(("m",), load_model(make_settings(model=str(path))), prefix_cache_tokens=0)
    return on, off, path


def run(worker, ids, params):
    """Through the scheduler, as a request is served."""
    from app.engine.generate import RequestGroup

    group = RequestGroup(worker.runner, ids, params, max_length=256)
    return collect([event for _, event in worker.scheduler.submit([group])], params)


def long_prompt(tok):
    ids = tok(
        "Passage: The bedroom is north of the garden. The bathroom is west of the garden. Question: How "
        "do you go from the bathroom to the office? Answer:"
    ).input_ids
    assert len(ids) >= MIN_REUSE + 4
    return ids


def test_a_prompt_extending_a_kept_one_prefills_only_the_rest(workers, reference):
    on, off, path = workers
    model, tok = reference(path)
    base = long_prompt(tok)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
    run(on, base, params)
    cache = on.runner.prefix_cache
    hits, reused = cache.hits, cache.reused_tokens
    extended = base + tok(" east and then north", add_special_tokens=False).input_ids
    got = run(on, extended, params)
    assert cache.hits == hits + 1 and cache.reused_tokens - reused >= len(base)
    plain = run(off, extended, params)
    assert got.choices[0].text == plain.choices[0].text
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=TOL)
    # and against a forward of the whole sequence by transformers itself
    ref_ids = ref_greedy(model, tok, extended, 8)
    lp = ref_logprobs(model, ref_ids)
    want = [lp[len(extended) + i - 1, t].item() for i, t in enumerate(ref_ids[len(extended) :])]
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(want, abs=TOL)


def test_the_same_prompt_again_and_seeded_sampling(workers):
    on, off, path = workers
    tok = on.runner.tokenizer
    ids = long_prompt(tok)
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=7, n=2, logprobs=1, ignore_eos=True)
    first = run(on, ids, params)
    hits = on.runner.prefix_cache.hits
    again = run(on, ids, params)
    assert on.runner.prefix_cache.hits == hits + 1  # all but the last prompt token reused
    plain = run(off, ids, params)
    for a, b, c in zip(first.choices, again.choices, plain.choices):
        assert a.text == b.text == c.text
        assert a.logprobs.token_logprobs == pytest.approx(c.logprobs.token_logprobs, abs=TOL)
        assert b.logprobs.token_logprobs == pytest.approx(c.logprobs.token_logprobs, abs=TOL)


def test_echo_scoring_prefills_in_full(workers, reference):
    on, _, path = workers
    model, tok = reference(path)
    ids = long_prompt(tok)
    run(on, ids, SamplingParams(max_tokens=2, temperature=0.0))
    hits = on.runner.prefix_cache.hits
    scored = run(on, ids + ids[1:5], SamplingParams(max_tokens=0, echo=True, logprobs=1))
    assert on.runner.prefix_cache.hits == hits
    lp = ref_logprobs(model, ids + ids[1:5])
    want = [None] + [lp[i - 1, t].item() for i, t in enumerate(ids + ids[1:5]) if i]
    got = scored.choices[0].logprobs.token_logprobs
    assert got[0] is None and got[1:] == pytest.approx(want[1:], abs=TOL)


def test_alone_runs_use_it_too(workers):
    """The in-process SoloRun (warm-up, tools) goes through the same prefill."""
    on, off, _ = workers
    ids = long_prompt(on.runner.tokenizer)
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=0)
    run(on, ids, params)
    hits = on.runner.prefix_cache.hits
    got = collect(iter(SoloRun(on.runner, ids + ids[:3], params, max_length=256)), params)
    assert on.runner.prefix_cache.hits == hits + 1
    want = collect(iter(SoloRun(off.runner, ids + ids[:3], params, max_length=256)), params)
    assert got.choices[0].text == want.choices[0].text


def test_http_reports_cached_prompt_tokens(gpt2_client, reference, gpt2_dir):
    """The second identical request reuses all but the last prompt token and says so in ``timing`` and a header;
    its answer and usage are the first one's."""
    _, tok = reference(gpt2_dir)
    prompt = (
        "Passage: The office is north of the hallway. The bathroom is east of the bedroom. Question: How do "
        "you go from the hallway to the bathroom? Answer:"
    )
    n = len(tok(prompt).input_ids)
    body = {"model": "tiny-gpt2", "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    first = gpt2_client.post("/v1/completions", json=body)
    second = gpt2_client.post("/v1/completions", json=body)
    assert second.get_json()["timing"]["cached_prompt_tokens"] == n - 1
    assert second.headers["X-Saker-Cached-Prompt-Tokens"] == str(n - 1)
    assert first.get_json()["timing"]["cached_prompt_tokens"] in (0, n - 1)  # 0 unless an earlier test sent it
    a, b = first.get_json(), second.get_json()
    assert a["usage"] == b["usage"] and a["usage"]["prompt_tokens"] == n
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert b["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        a["choices"][0]["logprobs"]["token_logprobs"], abs=TOL
    )
    metrics = gpt2_client.get("/metrics").get_data(as_text=True)
    samples = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith("saker_prefix_cache"))
    cache = gpt2_client.application.extensions["saker.service"].worker.runner.prefix_cache
    assert cache.hits >= 1
    assert float(samples["saker_prefix_cache_hits_total"]) == cache.hits
    assert float(samples["saker_prefix_cache_reused_tokens_total"]) == cache.reused_tokens
    assert float(samples["saker_prefix_cache_tokens"]) == cache.tokens > 0


def test_out_of_memory_empties_the_prefix_cache(workers, monkeypatch):
    """Kept prompts are the first memory given back: an OOM while keeping one, or in a request, clears them."""
    on, _, _ = workers
    cache = on.runner.prefix_cache
    ids = long_prompt(on.runner.tokenizer)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    run(on, ids, params)
    assert len(cache)
    real_decode = on.runner.slot_step

    def failing(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(on.runner, "slot_step", failing)
    with pytest.raises(torch.OutOfMemoryError):
        run(on, ids + [5], params)
    assert len(cache) == 0 and cache.tokens == 0
    monkeypatch.setattr(on.runner, "slot_step", real_decode)

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    run(on, ids, params)
    monkeypatch.setattr(cache, "store", no_room)
    got = run(on, ids[:-1] + [7, 8], params)  # served; the prompt is just not kept
    assert got.choices[0].finish_reason == "length" and len(cache) == 0
