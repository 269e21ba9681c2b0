"""The embedded SmolLM2 under a real gunicorn, driven by the official openai client: completions and chat,
plain and streamed, against apply_chat_template + model.generate(); dropped streams free the worker.

The server runs in float32 (``SAKER_QUANTIZE=none``), the precision of the reference ``generate()`` it is compared
with: as served by default (int4 weights, int16 kernel inputs) its answers are its own, and the libraries'
tests on the default configuration are in tests/live/test_agent_libraries.py."""

from __future__ import annotations

import re
import time

import openai
import pytest
import requests
import torch

from references import continuation
from servers import Gunicorn

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol_dir(saker_cache):
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import ensure_default_model

    return ensure_default_model(LoadConfig(cache_dir=str(saker_cache)))


@pytest.fixture(scope="module")
def server(smol_dir, saker_cache):
    srv = Gunicorn({"SAKER_CACHE_DIR": str(saker_cache), "SAKER_THREADS": "4", "SAKER_QUANTIZE": "none"})
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def smol(smol_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (
        AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float32).eval(),
        AutoTokenizer.from_pretrained(str(smol_dir)),
    )


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_server_logs_what_it_serves(server):
    assert re.search(r"serving SmolLM2-135M-Instruct .* from embedded default", server.output())


def test_completion_plain_and_streamed(client, smol):
    model, tok = smol
    prompt = "The capital of France is"
    ids = tok(prompt).input_ids
    out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0].tolist()
    expected = continuation(tok, ids, out)
    plain = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=8, temperature=0)
    assert plain.choices[0].text == expected and "Paris" in expected
    pieces = []
    for chunk in client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=8, temperature=0, stream=True
    ):
        pieces.append(chunk.choices[0].text)
    assert "".join(pieces) == expected
    assert len([p for p in pieces if p]) > 1, "tokens arrive in several chunks"


def test_chat_plain_and_streamed(client, smol):
    model, tok = smol
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0].tolist()
    expected = continuation(tok, ids, out)
    plain = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=16, temperature=0
    )
    assert plain.choices[0].message.content == expected
    assert "Paris" in expected
    assert plain.usage.prompt_tokens == len(ids)
    streamed = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.total_tokens == plain.usage.total_tokens


def test_dropped_streams_free_the_worker(server):
    """Open long streams, read one frame, drop them: each generation stops early and the next request is
    answered (the server logs how many tokens each dropped stream generated)."""
    body = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    for _ in range(2):
        with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=60) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(lines).startswith(b"data: ")
    answer = requests.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
    assert answer.status_code == 200
    deadline = time.time() + 30
    ended = []
    while time.time() < deadline and len(ended) < 2:
        ended = [int(n) for n in re.findall(r"ended early after (\d+) generated tokens", server.output())]
        time.sleep(0.2)
    assert len(ended) == 2 and all(n < 4000 for n in ended), ended


class City(__import__("pydantic").BaseModel):
    city: str
    country: str


def test_openai_client_parses_a_pydantic_model(client):
    """``chat.completions.parse`` sends the model's JSON schema (strict) and parses the answer into it."""
    done = client.chat.completions.parse(
        model="SmolLM2-135M-Instruct",
        response_format=City,
        temperature=0,
        messages=[{"role": "user", "content": "What is the capital of Italy?"}],
    )
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.city and parsed.country
    assert done.choices[0].finish_reason == "stop"
