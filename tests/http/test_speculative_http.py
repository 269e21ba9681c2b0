"""Speculative decoding over HTTP (``SAKER_SPECULATIVE=ngram``): answers equal those of the same server without it
(text, logprobs, seeded samples, ``n``, stop strings), a stream equals its non-streamed answer, and the acceptance
shows per request (``timing``) and in ``/metrics`` under vLLM's ``spec_decode`` names."""

from __future__ import annotations

import json

import pytest

from app.sse import iter_events
from conftest import make_settings

BODIES = [
    {"prompt": "red green blue red green blue red green blue red", "max_tokens": 30, "temperature": 0, "logprobs": 2},
    {"prompt": "a b c d a b c d a b c", "max_tokens": 24, "temperature": 0.8, "seed": 5, "n": 2, "logprobs": 1},
    {"prompt": "one two one two one two", "max_tokens": 24, "temperature": 0, "stop": ["two one"]},
    {"prompt": ["x y z x y z x", "hello hello hello"], "max_tokens": 16, "temperature": 0, "presence_penalty": 0.5},
    {
        "prompt": "red green blue red green blue red",
        "max_tokens": 30,
        "temperature": 0,
        "structured_outputs": {"json": {"type": "object", "properties": {"c": {"enum": ["red", "green", "blue"]}}}},
    },
]


@pytest.fixture(scope="module")
def speculating(llama_dir):
    from app import create_app
    from app.engine.worker import Worker

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


@pytest.mark.parametrize("body", BODIES)
def test_answers_equal_those_without_speculation_and_streams_equal_answers(speculating, llama_client, body):
    got, plain = answer(speculating, body), answer(llama_client, body)
    assert len(got["choices"]) == len(plain["choices"])
    for x, y in zip(got["choices"], plain["choices"]):
        assert (x["text"], x["finish_reason"]) == (y["text"], y["finish_reason"])
        if y["logprobs"]:
            assert x["logprobs"]["tokens"] == y["logprobs"]["tokens"]
            assert x["logprobs"]["token_logprobs"] == pytest.approx(y["logprobs"]["token_logprobs"], abs=1e-4)
    raw = speculating.post("/v1/completions", json={"model": "tiny-llama", **body, "stream": True})
    chunks = [json.loads(e.data) for e in iter_events(raw.get_data(as_text=True)) if e.data != "[DONE]"]
    for choice in got["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert mine[-1]["finish_reason"] == choice["finish_reason"]


def test_acceptance_shows_in_timing_and_metrics(speculating):
    body = answer(speculating, {**BODIES[0], "max_tokens": 40, "ignore_eos": True})
    timing = body["timing"]
    assert timing["speculative_draft_tokens"] > 0
    assert 0 <= timing["speculative_accepted_tokens"] <= timing["speculative_draft_tokens"]
    metrics = speculating.get("/metrics").get_data(as_text=True)
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm:spec_decode_num_") and "_total{" in line and "per_pos" not in line
    }
    assert values["vllm:spec_decode_num_draft_tokens_total"] >= timing["speculative_draft_tokens"]
    assert values["vllm:spec_decode_num_accepted_tokens_total"] <= values["vllm:spec_decode_num_draft_tokens_total"]
    assert values["vllm:spec_decode_num_drafts_total"] > 0
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny-llama",position="0"}' in metrics
