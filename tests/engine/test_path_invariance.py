"""The default configuration (the embedded SmolLM2 served int4, prefix cache on, long prompts in chunks) answers a
request the same whatever path its prompt took: prefilled whole, in chunks of several sizes, from the prefix
cache, alone or beside other requests. The reference is independent of the engine: a plain greedy loop over the
same modules, each step one forward of the whole sequence with no cache, its argmax and its log-softmax.

Before ``app/engine/model/attention.py`` the second of two identical requests (45 of its 46 prompt tokens from the
prefix cache) answered ``1+1 = 2`` where the first answered ``1 + 1 = 2``: SDPA's float32 results depend on how
many queries come together, and the int4 kernels' bfloat16 inputs turn those ulps into logprob changes of 0.2.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from app.engine.core.blocks import BLOCK
from app.engine.params import SamplingParams
from conftest import make_settings, make_worker

pytestmark = pytest.mark.slow

MESSAGES = [
    {"role": "system", "content": "You are a careful assistant. Answer in one short sentence, with no preamble."},
    {"role": "user", "content": "what is 1+1? please provide the result without any other text."},
]
TOKENS = 8
TOP = 5


@pytest.fixture(scope="module")
def worker(saker_cache):
    worker = make_worker(make_settings(cache_dir=str(saker_cache)))
    assert "int4" in worker.info.precision, worker.info.precision  # the default configuration, as served
    return worker


@pytest.fixture(scope="module")
def prompt(worker):
    ids = worker.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


@pytest.fixture(scope="module")
def reference(worker, prompt):
    """Greedy tokens and raw logprobs from whole-sequence forwards (no KV cache, no engine), the log-softmax in
    float64 (the exact value the engine's rounds to float32; PyTorch's float32 one is 3.7e-5 off on AVX2)."""
    model, ids, out = worker.runner.model, list(prompt), []
    with torch.inference_mode():
        for _ in range(TOKENS):
            logprobs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].double(), dim=-1)
            token = int(logprobs.argmax())
            out.append((token, float(logprobs[token]), torch.topk(logprobs, TOP).values.tolist()))
            ids.append(token)
    return out


PARAMS = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP)


def answer(worker, prompt):
    [output], _ = worker.complete([prompt], PARAMS, worker.info.context_length)
    choice = output.choices[0]
    tops = [sorted(top.values(), reverse=True)[:TOP] for top in choice.logprobs.top_logprobs]
    return choice.token_ids, choice.logprobs.token_logprobs, tops


def assert_matches(got, reference):
    tokens, logprobs, tops = got
    assert tokens == [token for token, _, _ in reference]
    for (_, want, want_top), lp, top in zip(reference, logprobs, tops):
        assert math.isclose(lp, want, abs_tol=1e-5), (lp, want)
        assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(top, want_top)), (top, want_top)


def fresh(worker, chunk: int):
    worker.prefix_cache.clear_cached()
    worker.engine.scheduler.prefill_chunk_tokens = chunk


def test_whole_chunked_and_cached_prefills_answer_as_the_plain_forward(worker, prompt, reference):
    assert len(prompt) > 40
    chunk_before = worker.engine.scheduler.prefill_chunk_tokens
    try:
        for chunk in (0, 7, 16, 32):
            fresh(worker, chunk)
            assert_matches(answer(worker, prompt), reference)
        # the same prompt again: its full blocks but the one with its last token come from the prefix cache
        reused = worker.prefix_cache.reused_tokens
        assert_matches(answer(worker, prompt), reference)
        assert worker.prefix_cache.reused_tokens - reused == (len(prompt) - 1) // BLOCK * BLOCK > 0
    finally:
        worker.engine.scheduler.prefill_chunk_tokens = chunk_before


def test_beside_other_requests_answers_as_the_plain_forward(worker, prompt, reference, monkeypatch):
    """Other requests (sampled, of other lengths, one sharing the prompt's start) decode in the same steps, and
    the prompt's chunks (16 tokens) ride in the same forwards as their decode tokens."""
    chunk_before = worker.engine.scheduler.prefill_chunk_tokens
    fresh(worker, 16)
    mixed = []
    real = worker.runner.flat_step

    def flat_step(tokens, positions, flat, logits_at):
        mixed.append(flat.rows > 0 and bool(flat.chunks))
        return real(tokens, positions, flat, logits_at)

    monkeypatch.setattr(worker.runner, "flat_step", flat_step)
    tokenizer = worker.tokenizer
    others = [
        tokenizer.encode("Write a short poem about the sea and the sky at night."),
        prompt[: len(prompt) // 2] + tokenizer.encode(" tell me a story"),
        tokenizer.encode("List three prime numbers: ") * 6,
    ]
    sampled = SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)
    threads = [
        threading.Thread(target=worker.complete, args=([ids], sampled, worker.info.context_length)) for ids in others
    ]
    for thread in threads:
        thread.start()
    try:
        while not worker.engine.batch.groups and any(thread.is_alive() for thread in threads):
            time.sleep(0.01)  # the others are decoding before the prompt comes
        assert_matches(answer(worker, prompt), reference)
    finally:
        for thread in threads:
            thread.join()
        worker.engine.scheduler.prefill_chunk_tokens = chunk_before
    assert worker.engine.max_rows_seen > 1 and any(mixed)
