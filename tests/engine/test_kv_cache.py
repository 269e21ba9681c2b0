"""The block pool's storage."""

from __future__ import annotations

import pytest
import torch


def test_pool_zeroes_blocks_at_first_use_copies_and_compacts():
    """Blocks are zeroed when first handed out (padding reads finite numbers), a block copies whole, and a compacted
    pool keeps exactly the blocks asked for, renumbered 1, 2, ..."""
    from types import SimpleNamespace

    from app.engine.core.blocks import BLOCK
    from app.engine.model.kv_cache import KVPool

    like = SimpleNamespace(layers=[SimpleNamespace(keys=torch.zeros(1, 2, 1, 4), values=torch.zeros(1, 2, 1, 3))] * 2)
    pool = KVPool(like, num_blocks=10)
    assert pool.keys[0].shape == (10 * BLOCK, 2, 4) and pool.values[1].shape == (10 * BLOCK, 2, 3)
    assert pool.touched == 1 and not pool.keys[0][:BLOCK].any()  # the null block
    for tensor in (*pool.keys, *pool.values):
        tensor[BLOCK:].fill_(float("nan"))  # what torch.empty may hold
    pool.touch(4)
    assert pool.touched == 4 and not pool.keys[1][: 4 * BLOCK].any() and pool.keys[1][4 * BLOCK :].isnan().all()
    pool.keys[0][2 * BLOCK : 3 * BLOCK] = torch.arange(BLOCK * 8.0).view(BLOCK, 2, 4)
    pool.copy_block(2, 3)
    assert torch.equal(pool.keys[0][3 * BLOCK : 4 * BLOCK], pool.keys[0][2 * BLOCK : 3 * BLOCK])
    small = pool.compacted([3])
    assert small.touched == 2 and torch.equal(small.keys[0][BLOCK : 2 * BLOCK], pool.keys[0][3 * BLOCK : 4 * BLOCK])


def test_an_idle_batch_gives_its_memory_back(gpt2_worker, reference, gpt2_dir, monkeypatch):
    """After a wide request of long rows, an idle pool keeps only the blocks the prefix cache holds (at most its
    limit), renumbered to the front of a fresh pool: it would otherwise keep every block the rows ever touched, memory
    that never came back. The compacted pool still answers as a plain forward."""
    from app.engine.core.blocks import BLOCK
    from app.engine.params import SamplingParams
    from references import ref_greedy

    worker = gpt2_worker
    batch = worker.engine.batch
    worker.prefix_cache.clear_cached()  # what earlier tests left
    monkeypatch.setattr(batch.blocks, "cached_limit", 8)  # released blocks kept cached: at most 8
    prompt = worker.encode("Hello world " * 30)
    worker.complete(
        [prompt], SamplingParams(n=16, best_of=16, max_tokens=100, temperature=1.0, seed=1, ignore_eos=True), 256
    )
    assert batch.blocks.held_blocks == 0
    cached = batch.blocks.cached_tokens // BLOCK
    assert 0 < cached <= 8
    # 16 rows of about 160 positions touched some 160 blocks; the pool now holds the cached ones and the null block
    assert batch.pool is not None and batch.pool.touched == cached + 1
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    [output], _ = worker.complete([prompt], params, 256)
    model, tok = reference(gpt2_dir)
    assert output.choices[0].token_ids == ref_greedy(model, tok, prompt, 8)[len(prompt) :]


def test_top_k_beyond_the_vocabulary_is_all_of_it(gpt2_client, reference, gpt2_dir):
    """A ``top_k`` past the vocabulary (past int64 too) keeps every token: the answer is the seeded draws over the
    whole distribution (oracle: the sampler's documented counter-based draws over a plain forward,
    ``references.ref_sampled`` with top-k off), which a cut to the 5 best would not give."""
    from app.engine.params import SamplingParams
    from references import continuation, ref_sampled

    model, tok = reference(gpt2_dir)
    ids = tok("Hello").input_ids
    whole = SamplingParams(max_tokens=16, temperature=1.0, seed=1)
    want = ref_sampled(model, ids, whole, 0, 16, eos=tok.eos_token_id)
    cut = ref_sampled(model, ids, SamplingParams(max_tokens=16, temperature=1.0, seed=1, top_k=5), 0, 16)
    assert cut[: len(want)] != want  # the check below tells the whole vocabulary from a cut
    for top_k in (2**63, 10**30, 100_000):
        resp = gpt2_client.post(
            "/v1/completions",
            json={
                "model": "tiny-gpt2",
                "prompt": "Hello",
                "max_tokens": 16,
                "top_k": top_k,
                "temperature": 1.0,
                "seed": 1,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
            },
        )
        assert resp.status_code == 200, resp.get_data(as_text=True)
        choice = resp.get_json()["choices"][0]
        assert [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]] == want
        assert choice["text"] == continuation(tok, ids, ids + want)


def test_a_float32_models_decode_rows_read_the_pool_in_place(gpt2_worker, reference, gpt2_dir, monkeypatch):
    """On the CPU, where the kernels are built, a float32 model's decode rows attend by the fixed-order kernel over
    the pool in place (``attention.flat_attention``), not by gathering their blocks for SDPA (prompt chunks still
    do); the answer is a plain forward's."""
    from app.engine.model import attention, cpu_kernels
    from app.engine.params import SamplingParams
    from references import ref_greedy

    if cpu_kernels.kernel() is None:
        pytest.skip("saker's CPU kernels are not built here")
    attended, gathered = [], []
    call, read = cpu_kernels.call, attention._read
    monkeypatch.setattr(cpu_kernels, "call", lambda *a: attended.append(a[0].shape[0]) or call(*a))
    monkeypatch.setattr(attention, "_read", lambda *a, **k: gathered.append(a[3] if len(a) > 3 else k) or read(*a, **k))
    prompt = gpt2_worker.encode("The pool is read in place")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    [output], _ = gpt2_worker.complete([prompt], params, 256)
    model, tok = reference(gpt2_dir)
    assert output.choices[0].token_ids == ref_greedy(model, tok, prompt, 6)[len(prompt) :]
    assert attended and "rows keys" not in gathered and "rows values" not in gathered
