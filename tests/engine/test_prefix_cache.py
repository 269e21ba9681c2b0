"""Prompt KV reuse: the cache's bookkeeping without a model, then requests that reuse a kept prefix against a
plain forward of the whole sequence and against the same worker with the cache off."""

from __future__ import annotations

import pytest
import torch

from app.engine.output.decoder import collect
from app.engine.params import SamplingParams
from app.engine.core.blocks import BLOCK, BlockManager, NoFreeBlocks
from references import check_reference, ref_greedy, ref_logprobs

TOL = 1e-4


def test_lookup_shares_the_longest_leading_run_of_full_blocks():
    blocks = BlockManager(num_blocks=64, cached_limit=32)
    a = list(range(3 * BLOCK + 5))
    keys_a = blocks.keys(a)
    assert len(keys_a) == 3  # full blocks only
    table = blocks.allocate(4)
    for block, key in zip(table, keys_a):
        blocks.register(block, key)
    # a prompt sharing a's first two blocks and then differing takes those two, held by both now
    b = a[: 2 * BLOCK] + [999] * BLOCK
    found = blocks.lookup(blocks.keys(b), len(b))
    assert found == table[:2] and blocks.refs[table[0]] == 2 and blocks.refs[table[2]] == 1
    # the chain: an equal block after a different one is not a hit
    c = [7] * BLOCK + a[BLOCK : 2 * BLOCK]
    assert blocks.lookup(blocks.keys(c), len(c)) == []
    # keys are per salt (the PEFT adapter)
    assert blocks.lookup(blocks.keys(a, salt="other-adapter"), len(a)) == []
    assert blocks.hits == 1 and blocks.reused_tokens == 2 * BLOCK and blocks.queried_tokens == len(a) + len(b) + len(c)


def test_released_blocks_stay_cached_until_needed_or_over_the_limit():
    blocks = BlockManager(num_blocks=8, cached_limit=2)  # 7 blocks to hand out (block 0 is the null block)
    prompts = [[i] * BLOCK for i in range(3)]
    tables = []
    for prompt in prompts:
        [block] = blocks.allocate(1)
        blocks.register(block, blocks.keys(prompt)[0])
        tables.append(block)
    assert 0 not in tables and blocks.cached_tokens == 3 * BLOCK
    blocks.release(tables)  # three cached blocks with no holder, two kept: the least recently released goes
    assert blocks.cached_tokens == 2 * BLOCK and blocks.held_blocks == 0
    assert blocks.lookup(blocks.keys(prompts[0]), BLOCK) == []
    assert blocks.lookup(blocks.keys(prompts[2]), BLOCK) == [tables[2]]
    blocks.release([tables[2]])
    # handing out prefers free blocks, then never used ones, then cached ones (least recently released first)
    assert blocks.free_blocks == 7
    got = blocks.allocate(5)
    assert tables[1] not in got and tables[2] not in got and blocks.cached_tokens == 2 * BLOCK
    assert blocks.allocate(1) == [tables[1]] and blocks.cached_tokens == BLOCK
    with pytest.raises(NoFreeBlocks):
        blocks.allocate(2)


def test_shared_blocks_free_with_their_last_holder_and_compact_renumbers_the_cached_ones():
    blocks = BlockManager(num_blocks=16, cached_limit=8)
    table = blocks.allocate(3)
    blocks.share(table[:2])  # a second candidate shares two full blocks
    keys = blocks.keys(list(range(2 * BLOCK)))
    for block, key in zip(table, keys):
        blocks.register(block, key)
    blocks.release(table)
    assert blocks.held_blocks == 2
    blocks.release(table[:2])
    assert blocks.held_blocks == 0 and blocks.cached_tokens == 2 * BLOCK
    kept = blocks.compact()
    assert sorted(kept) == sorted(table[:2]) and blocks.fresh == 3
    assert blocks.lookup(keys, 2 * BLOCK + 1) == [1, 2]
    blocks.clear_cached()
    assert blocks.cached_tokens == 0 and blocks.held_blocks == 2


# -- with a model --------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["gpt2", "llama"])
def workers(request):
    """The same model twice: prefix cache on and off."""
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.core.worker import Worker

    path = request.getfixturevalue(f"{request.param}_dir")
    loaded = load_model(LoadConfig(model=str(path)))
    on = Worker.from_loaded(("m",), loaded, prefix_cache_tokens=4096)
    off = Worker.from_loaded(("m",), load_model(LoadConfig(model=str(path))), prefix_cache_tokens=0)
    return on, off, path


def run(worker, ids, params):
    """Through the scheduler, as a request is served."""
    from app.engine.core.sequence import RequestGroup

    group = RequestGroup(worker.runner, ids, params, max_length=256)
    return collect([event for _, event in worker.engine.submit([group])], params)


def long_prompt(tok):
    ids = tok(
        "Passage: The bedroom is north of the garden. The bathroom is west of the garden. Question: How "
        "do you go from the bathroom to the office? Answer:"
    ).input_ids
    assert len(ids) >= 2 * BLOCK + 1
    return ids


def test_a_prompt_extending_a_kept_one_prefills_only_the_rest(workers, reference):
    on, off, path = workers
    model, tok = reference(path)
    base = long_prompt(tok)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
    run(on, base, params)
    cache = on.prefix_cache
    hits, reused = cache.hits, cache.reused_tokens
    extended = base + tok(" east and then north", add_special_tokens=False).input_ids
    got = run(on, extended, params)
    assert cache.hits == hits + 1 and cache.reused_tokens - reused == len(base) // BLOCK * BLOCK
    plain = run(off, extended, params)
    assert got.choices[0].text == plain.choices[0].text
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=TOL)
    # and against a forward of the whole sequence by transformers itself
    ref_ids = ref_greedy(model, tok, extended, 8)
    lp = ref_logprobs(model, ref_ids)
    want = [lp[len(extended) + i - 1, t].item() for i, t in enumerate(ref_ids[len(extended) :])]
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(want, abs=TOL)


def test_an_answer_sent_back_in_the_next_prompt_is_found_in_the_cache(workers, reference):
    """The blocks a request's answer fills are kept too: a conversation whose next prompt carries the answer reuses
    every full block of prompt and answer (the last answer token is never fed, so it is not among them), and the
    next answer is the plain forward's."""
    on, _, path = workers
    model, tok = reference(path)
    base = long_prompt(tok)
    first = run(on, base, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    answer = first.choices[0].token_ids
    follow = base + answer + tok(" and then", add_special_tokens=False).input_ids
    reused = on.prefix_cache.reused_tokens
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True)
    got = run(on, follow, params)
    fed = len(base) + len(answer) - 1
    assert on.prefix_cache.reused_tokens - reused == fed // BLOCK * BLOCK > len(base) // BLOCK * BLOCK
    ref_ids = ref_greedy(model, tok, follow, 6)
    lp = ref_logprobs(model, ref_ids)
    assert got.choices[0].token_ids == ref_ids[len(follow) :]
    want = [lp[len(follow) + i - 1, t].item() for i, t in enumerate(ref_ids[len(follow) :])]
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(want, abs=TOL)


def test_the_same_prompt_again_and_seeded_sampling(workers, reference):
    on, off, path = workers
    model, tok = reference(path)
    ids = long_prompt(tok)
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=7, n=2, logprobs=1, ignore_eos=True)
    first = run(on, ids, params)
    hits = on.prefix_cache.hits
    again = run(on, ids, params)
    assert on.prefix_cache.hits == hits + 1  # every full block but the one with the last prompt token reused
    plain = run(off, ids, params)
    check_reference(again, model, tok, ids, params)  # the cached path's logprobs are transformers' own
    for a, b, c in zip(first.choices, again.choices, plain.choices):
        assert a.text == b.text == c.text
        assert a.logprobs.token_logprobs == pytest.approx(c.logprobs.token_logprobs, abs=TOL)
        assert b.logprobs.token_logprobs == pytest.approx(c.logprobs.token_logprobs, abs=TOL)


def test_echo_scoring_prefills_in_full(workers, reference):
    on, _, path = workers
    model, tok = reference(path)
    ids = long_prompt(tok)
    run(on, ids, SamplingParams(max_tokens=2, temperature=0.0))
    hits = on.prefix_cache.hits
    scored = run(on, ids + ids[1:5], SamplingParams(max_tokens=0, echo=True, logprobs=1))
    assert on.prefix_cache.hits == hits
    lp = ref_logprobs(model, ids + ids[1:5])
    want = [None] + [lp[i - 1, t].item() for i, t in enumerate(ids + ids[1:5]) if i]
    got = scored.choices[0].logprobs.token_logprobs
    assert got[0] is None and got[1:] == pytest.approx(want[1:], abs=TOL)


def test_http_reports_cached_prompt_tokens(gpt2_client, reference, gpt2_dir):
    """The second identical request reuses the prompt's full blocks (all but the one holding its last token) and
    says so in ``timing`` and a header; its answer and usage are the first one's, and both are a plain forward's
    (greedy argmax and log-softmax). The session's worker starts this test with its prefix cache emptied, so the
    first request is computed in full whatever ran before."""
    model, tok = reference(gpt2_dir)
    cache = gpt2_client.application.extensions["saker.service"].worker.prefix_cache
    assert cache.held_blocks == 0  # between requests the engine is idle
    cache.clear_cached()
    prompt = (
        "Passage: The office is north of the hallway. The bathroom is east of the bedroom. Question: How do "
        "you go from the hallway to the bathroom? Answer:"
    )
    n = len(tok(prompt).input_ids)
    cached = (n - 1) // BLOCK * BLOCK
    body = {"model": "tiny-gpt2", "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    first = gpt2_client.post("/v1/completions", json=body)
    second = gpt2_client.post("/v1/completions", json=body)
    assert second.get_json()["timing"]["cached_prompt_tokens"] == cached > 0
    assert second.headers["X-Saker-Cached-Prompt-Tokens"] == str(cached)
    assert first.get_json()["timing"]["cached_prompt_tokens"] == 0
    assert "X-Saker-Cached-Prompt-Tokens" not in first.headers or first.headers["X-Saker-Cached-Prompt-Tokens"] == "0"
    a, b = first.get_json(), second.get_json()
    assert a["usage"] == b["usage"] and a["usage"]["prompt_tokens"] == n
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    ids = tok(prompt).input_ids
    want = ref_greedy(model, tok, ids, 6)
    lp = ref_logprobs(model, want)
    for body in (a, b):
        assert body["choices"][0]["text"] == tok.decode(want[len(ids) :])
        assert body["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
            [lp[len(ids) - 1 + i, t].item() for i, t in enumerate(want[len(ids) :])], abs=TOL
        )
    metrics = gpt2_client.get("/metrics").get_data(as_text=True)
    samples = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith("saker_prefix_cache"))
    assert cache.hits >= 1
    assert float(samples["saker_prefix_cache_hits_total"]) == cache.hits
    assert float(samples["saker_prefix_cache_reused_tokens_total"]) == cache.reused_tokens
    assert float(samples["saker_prefix_cache_tokens"]) == cache.cached_tokens > 0


def test_out_of_memory_empties_the_prefix_cache(workers, monkeypatch):
    """Kept prompts are the first memory given back: an OOM in a request forgets them."""
    on, _, _ = workers
    cache = on.prefix_cache
    ids = long_prompt(on.runner.tokenizer)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    run(on, ids, params)
    assert cache.cached_tokens

    def failing(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(on.runner, "rows_step", failing)
    with pytest.raises(torch.OutOfMemoryError):
        run(on, ids + [5], params)
    assert cache.cached_tokens == 0
    monkeypatch.undo()
    got = run(on, ids, params)  # served again, and kept again
    assert got.choices[0].finish_reason == "length" and cache.cached_tokens
