"""Speculative decoding over HTTP (``SAKER_SPECULATIVE=ngram``): answers equal references outside the engine (text,
logprobs, seeded samples, ``n``, stop strings, a constrained output), a stream's text equals that reference too, and
the acceptance shows per request (``timing``) and in ``/metrics`` under vLLM's ``spec_decode`` names.

Oracle for every answer: the model loaded by transformers, one plain whole-sequence forward per token
(``references.ref_sampled``): its argmax after the request's penalties and bias for greedy requests, the sampler's
documented counter-based draw (a candidate's draw depends on its seed and step only) for seeded ones, under the masks
of llguidance's own matcher for a constrained one; its log-softmax for the logprobs; the tokenizer's decode for the
text, cut before a stop string's first occurrence. Never the same server with speculation off."""

from __future__ import annotations

import json

import pytest

from app.engine.params import SamplingParams
from tooling.sse import iter_events
from conftest import make_settings
from references import continuation, grammar_allowed, ref_logprobs, ref_sampled

TOL = 1e-4
PATTERN = "(red|green|blue)( (red|green|blue)){2,6}"
BODIES = [
    {"prompt": "red green blue red green blue red green blue red", "max_tokens": 30, "temperature": 0, "logprobs": 2},
    {"prompt": "a b c d a b c d a b c", "max_tokens": 24, "temperature": 0.8, "seed": 5, "n": 2, "logprobs": 1},
    {"prompt": "one two one two one two", "max_tokens": 24, "temperature": 0, "stop": ["two one"]},
    {"prompt": ["x y z x y z x", "hello hello hello"], "max_tokens": 16, "temperature": 0, "presence_penalty": 0.5},
    {
        "prompt": "red green blue red green blue red",
        "max_tokens": 30,
        "temperature": 0,
        "structured_outputs": {"regex": PATTERN},
    },
]


@pytest.fixture(scope="module")
def speculating(llama_dir):
    from app import create_app
    from app.engine.core.worker import Worker

    settings = make_settings(
        model=str(llama_dir),
        served_model_name="tiny-llama",
        speculative="ngram",
        speculative_tokens=4,
        speculative_max_rows=8,
        speculative_ngram_min=1,
        max_batch_rows=8,
    )
    worker = Worker.from_settings(settings)
    worker.load()
    return create_app(settings, worker=worker).test_client()


def answer(client, body) -> dict:
    response = client.post("/v1/completions", json={"model": "tiny-llama", **body})
    assert response.status_code == 200, response.get_json()
    return response.get_json()


def token_ids(choice) -> list[int]:
    """The answer's token ids (asked for with ``return_tokens_as_token_ids``)."""
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


def expected(model, tok, body, choice, prompt_index) -> tuple[str, str, list[int]]:
    """The reference for ``choice`` of ``body``: (text, finish_reason, tokens)."""
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    n = body.get("n", 1)
    ids = tok(prompts[prompt_index]).input_ids
    params = SamplingParams(
        n=n,
        max_tokens=body["max_tokens"],
        temperature=body["temperature"],
        seed=body.get("seed"),
        presence_penalty=body.get("presence_penalty", 0.0),
        logit_bias=tuple((int(k), float(v)) for k, v in body.get("logit_bias", {}).items()),
    )
    eos = None if body.get("ignore_eos") else tok.eos_token_id
    allowed = None
    if "structured_outputs" in body:
        allowed = grammar_allowed(tok, body["structured_outputs"]["regex"], tok.eos_token_id)
    tokens = ref_sampled(
        model, ids, params, choice["index"] % n, body["max_tokens"], allowed=allowed, eos=eos, follow=token_ids(choice)
    )
    text = continuation(tok, ids, ids + tokens)
    for stop in body.get("stop", ()):
        if stop in text:
            return text[: text.index(stop)], "stop", tokens
    ended = (eos is not None and tokens[-1] == eos) or (allowed is not None and allowed.complete(tokens))
    return text, "stop" if ended else "length", tokens


@pytest.mark.parametrize("body", BODIES, ids=["greedy", "seeded-n", "stop", "penalty-two-prompts", "regex"])
def test_answers_and_streams_equal_the_reference(speculating, reference, llama_dir, body):
    model, tok = reference(llama_dir)
    shown = {"logprobs": 0, **body, "return_tokens_as_token_ids": True}
    got = answer(speculating, shown)
    n = body.get("n", 1)
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    assert sorted(c["index"] for c in got["choices"]) == list(range(len(prompts) * n))
    for choice in got["choices"]:
        p = choice["index"] // n
        text, reason, tokens = expected(model, tok, body, choice, p)
        assert (choice["text"], choice["finish_reason"]) == (text, reason)
        ids = tok(prompts[p]).input_ids
        made = token_ids(choice)
        assert made == tokens[: len(made)]
        lp = ref_logprobs(model, ids + made)
        want = [lp[len(ids) - 1 + i, t].item() for i, t in enumerate(made)]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(want, abs=TOL)
        if "structured_outputs" in body and reason == "stop":
            import re

            assert re.fullmatch(PATTERN, choice["text"])
    raw = speculating.post("/v1/completions", json={"model": "tiny-llama", **body, "stream": True})
    chunks = [json.loads(e.data) for e in iter_events(raw.get_data(as_text=True)) if e.data != "[DONE]"]
    for choice in got["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]  # (checked against the reference above)
        assert mine[-1]["finish_reason"] == choice["finish_reason"]


def test_acceptance_shows_in_timing_and_metrics(speculating, reference, llama_dir):
    """An answer that repeats its prompt: the prompt is one token over and over and a logit bias makes that token
    the answer too, so every guess prompt lookup makes (what followed that token before: itself) must be kept.
    Oracle for the answer: a plain forward's argmax under the same bias (``references.ref_sampled``)."""
    model, tok = reference(llama_dir)
    word = tok("red").input_ids[-1]
    prompt = [tok.bos_token_id, *[word] * 12]
    body = {
        "prompt": prompt,
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
        "logit_bias": {str(word): 100},
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    got = answer(speculating, body)
    params = SamplingParams(max_tokens=40, temperature=0, logit_bias=((word, 100.0),))
    want = ref_sampled(model, prompt, params, 0, 40)
    assert want == [word] * 40  # the bias does force it: the guesses are all right
    assert token_ids(got["choices"][0]) == want
    timing = got["timing"]
    assert timing["speculative_draft_tokens"] > 0
    assert timing["speculative_accepted_tokens"] == timing["speculative_draft_tokens"]
    metrics = speculating.get("/metrics").get_data(as_text=True)
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm:spec_decode_num_") and "_total{" in line and "per_pos" not in line
    }
    assert values["vllm:spec_decode_num_draft_tokens_total"] >= timing["speculative_draft_tokens"]
    assert values["vllm:spec_decode_num_accepted_tokens_total"] >= timing["speculative_accepted_tokens"] > 0
    assert values["vllm:spec_decode_num_accepted_tokens_total"] <= values["vllm:spec_decode_num_draft_tokens_total"]
    assert values["vllm:spec_decode_num_drafts_total"] > 0
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny-llama",position="0"}' in metrics
