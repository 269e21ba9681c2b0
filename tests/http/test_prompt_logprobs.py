"""vLLM's prompt_logprobs (completions and chat, plain and streamed) against a plain forward's log-softmax, and
return_tokens_as_token_ids against the tokenizer."""

from __future__ import annotations


import pytest
import torch

from tooling.sse import iter_json
from references import ref_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = "The capital of France is Paris. The capital of Italy is"


def post(client, url="/v1/completions", **body):
    resp = client.post(url, json={"model": "tiny-gpt2", "temperature": 0, **body})
    assert resp.status_code == 200, resp.get_data(as_text=True)
    return resp.get_json()


def check_against_reference(entries, ids, lp, k):
    assert len(entries) == len(ids) and entries[0] is None
    for i, entry in enumerate(entries[1:], start=1):
        row, token = lp[i - 1], ids[i]
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
        assert mine["rank"] == int((row > row[token]).sum()) + 1
        top = torch.topk(row, k)
        for rank, (value, other) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            assert entry[str(other)]["logprob"] == pytest.approx(value, abs=1e-4)
            if other != token:
                assert entry[str(other)]["rank"] == rank
        assert len(entry) in (k, k + 1)


def test_completions_prompt_logprobs_match_a_plain_forward(gpt2_client, gpt2_dir, reference):
    model, tok = reference(gpt2_dir)
    ids = tok(PROMPT)["input_ids"]
    lp = ref_logprobs(model, ids)
    body = post(gpt2_client, prompt=PROMPT, max_tokens=2, prompt_logprobs=3)
    entries = body["choices"][0]["prompt_logprobs"]
    check_against_reference(entries, ids, lp, 3)
    assert entries[1][str(ids[1])]["decoded_token"] == tok.decode([ids[1]])
    frames = gpt2_client.post(
        "/v1/completions",
        json={
            "model": "tiny-gpt2",
            "prompt": PROMPT,
            "max_tokens": 2,
            "temperature": 0,
            "prompt_logprobs": 3,
            "stream": True,
        },
    )
    chunks = list(iter_json(frames.get_data()))
    assert chunks[0]["choices"][0]["prompt_logprobs"] == entries
    assert all("prompt_logprobs" not in c["choices"][0] for c in chunks[1:])
    assert "prompt_logprobs" not in post(gpt2_client, prompt=PROMPT, max_tokens=1)["choices"][0]


def test_with_echo_each_keeps_its_own_k(gpt2_client):
    body = post(gpt2_client, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, prompt_logprobs=4)
    choice = body["choices"][0]
    assert all(top is None or len(top) <= 2 for top in choice["logprobs"]["top_logprobs"])
    assert all(entry is None or len(entry) >= 4 for entry in choice["prompt_logprobs"])


def test_chat_prompt_logprobs_cover_the_rendered_prompt(llama_client):
    resp = llama_client.post(
        "/v1/chat/completions",
        json={
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 1,
            "prompt_logprobs": 1,
        },
    )
    body = resp.get_json()
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"] and body["prompt_logprobs"][0] is None


def test_return_tokens_as_token_ids(gpt2_client, gpt2_dir, reference):
    _, tok = reference(gpt2_dir)
    body = post(gpt2_client, prompt=PROMPT, max_tokens=6, logprobs=2, return_tokens_as_token_ids=True, ignore_eos=True)
    choice = body["choices"][0]
    tokens = choice["logprobs"]["tokens"]
    assert all(t.startswith("token_id:") for t in tokens)
    assert tok.decode([int(t.split(":")[1]) for t in tokens]) == choice["text"]
    assert all(key.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for key in top)
    plain = post(gpt2_client, prompt=PROMPT, max_tokens=6, logprobs=2, ignore_eos=True)["choices"][0]
    assert plain["text"] == choice["text"]
    assert plain["logprobs"]["token_logprobs"] == choice["logprobs"]["token_logprobs"]


def test_limits(gpt2_client):
    resp = gpt2_client.post("/v1/completions", json={"model": "tiny-gpt2", "prompt": "x", "prompt_logprobs": 21})
    assert resp.status_code == 400 and resp.get_json()["error"]["param"] == "prompt_logprobs"
    resp = gpt2_client.post("/v1/completions", json={"model": "tiny-gpt2", "prompt": "x", "prompt_logprobs": -1})
    assert resp.status_code == 400 and resp.get_json()["error"]["param"] == "prompt_logprobs"
