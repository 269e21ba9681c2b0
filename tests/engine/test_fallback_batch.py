"""The fallback for models whose KV cache cannot be kept in slots: a tiny Mistral with a sliding window (its cache
layers keep only the window, so rows cannot be written per slot). Such a model decodes in the left-padded batch,
one request at a time, and its answers still equal transformers' own: greedy text = ``generate()``, logprobs = a
plain forward's log-softmax."""

from __future__ import annotations


import pytest

from app.engine.generate import PaddedBatch, RequestGroup
from app.engine.output import collect
from app.engine.params import SamplingParams
from app.tiny_models import copy_tokenizer, llama_model
from conftest import make_settings
from references import continuation, ref_greedy, ref_logprobs

WINDOW = 8


@pytest.fixture(scope="module")
def mistral_dir(llama_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-mistral")
    copy_tokenizer(llama_dir, path)
    tok = AutoTokenizer.from_pretrained(str(path))
    llama_model(tok, kind="mistral", sliding_window=WINDOW, seed=1).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def worker(mistral_dir):
    from app.engine.loader import load_model
    from app.engine.worker import Worker

    return Worker.from_loaded(("m",), load_model(make_settings(model=str(mistral_dir))), max_batch_rows=8)


def test_sliding_window_model_uses_the_padded_batch(worker):
    assert not worker.runner.plain_cache
    assert isinstance(worker.scheduler.batch, PaddedBatch)


def test_answers_equal_transformers_and_requests_run_one_at_a_time(worker, mistral_dir, reference):
    model, tok = reference(mistral_dir)
    prompts = [tok("Once upon a time there was a small model").input_ids, tok("Hello").input_ids]
    assert len(prompts[0]) > WINDOW  # the window matters within the prompt
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=1, ignore_eos=True)
    groups = [RequestGroup(worker.runner, ids, params, max_length=256, tag=i) for i, ids in enumerate(prompts)]
    per = {0: [], 1: []}
    for tag, event in worker.scheduler.submit(groups):
        per[tag].append(event)
    assert worker.scheduler.max_rows_seen == 1
    for i, ids in enumerate(prompts):
        choice = collect(per[i], params).choices[0]
        full = ref_greedy(model, tok, ids, 20)
        assert choice.token_ids == full[len(ids) :]
        assert choice.text == continuation(tok, ids, full)
        lp = ref_logprobs(model, full)
        want = [lp[p - 1, full[p]].item() for p in range(len(ids), len(full))]
        assert choice.logprobs.token_logprobs == pytest.approx(want, abs=1e-4)
