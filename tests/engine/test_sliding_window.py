"""Sliding-window attention over the block pool: a tiny Mistral whose window (8) is shorter than its prompts keeps
every position in blocks, and the attention function's mask shows each query only the last 8 positions up to its
own. Its answers equal transformers' own (greedy text = ``generate()``, logprobs = a plain forward's log-softmax)
alone, batched, and with prompts computed in chunks shorter and longer than the window. A model whose cache cannot
live in blocks (recurrent state) is refused at load, saying why."""

from __future__ import annotations


import pytest

from app.engine.core.sequence import RequestGroup
from app.engine.output.decoder import collect
from app.engine.params import SamplingParams
from tooling.tiny_models import copy_tokenizer, llama_model
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


@pytest.fixture(scope="module", params=[0, 5, 12])
def worker(request, mistral_dir):
    """Prompts whole (0), or in chunks of 5 and 12 tokens: shorter and longer than the window."""
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.core.worker import Worker

    return Worker.from_loaded(
        ("m",), load_model(LoadConfig(model=str(mistral_dir))), max_batch_rows=8, prefill_chunk_tokens=request.param
    )


def test_answers_equal_transformers_alone_batched_and_chunked(worker, mistral_dir, reference):
    model, tok = reference(mistral_dir)
    prompts = [tok("Once upon a time there was a small model").input_ids, tok("Hello").input_ids]
    assert len(prompts[0]) > WINDOW  # the window matters within the prompt
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=1, ignore_eos=True)
    groups = [RequestGroup(worker.runner, ids, params, max_length=256, tag=i) for i, ids in enumerate(prompts)]
    per = {0: [], 1: []}
    for tag, event in worker.engine.submit(groups):
        per[tag].append(event)
    assert worker.engine.max_rows_seen == 2  # the two requests share the steps
    for i, ids in enumerate(prompts):
        choice = collect(per[i], params).choices[0]
        full = ref_greedy(model, tok, ids, 20)
        assert choice.token_ids == full[len(ids) :]
        assert choice.text == continuation(tok, ids, full)
        lp = ref_logprobs(model, full)
        want = [lp[p - 1, full[p]].item() for p in range(len(ids), len(full))]
        assert choice.logprobs.token_logprobs == pytest.approx(want, abs=1e-4)


def test_a_model_whose_cache_cannot_live_in_blocks_is_refused_at_load(llama_dir):
    """A tiny Mamba (recurrent state, no keys and values per position): a clear line at load, not a wrong answer."""
    from transformers import AutoTokenizer, MambaConfig, MambaForCausalLM

    from app.engine.model.runner import ModelRunner
    from app.errors import ConfigError

    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    config = MambaConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=2, state_size=4, intermediate_size=32)
    with pytest.raises(ConfigError, match="cannot be served: its cache has LinearAttentionLayer layers"):
        ModelRunner(MambaForCausalLM(config).eval(), tok, (tok.eos_token_id,))
