"""A real gunicorn on 127.0.0.1 with a tiny model, driven by the official openai client."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import requests
import torch

from servers import Gunicorn, openai_client, running

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(gpt2_dir):
    env = {"SAKER_MODEL": str(gpt2_dir), "SAKER_SERVED_MODEL_NAME": "tiny-gpt2,alias-gpt2", "SAKER_THREADS": "4"}
    with running(env) as srv:
        yield srv


@pytest.fixture()
def client(server):
    return openai_client(server)


def test_openai_client_completion_matches_generate(client, reference, gpt2_dir):
    model, tok = reference(gpt2_dir)
    prompt = "The capital of France is"
    ids = tok(prompt).input_ids
    out = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, pad_token_id=tok.eos_token_id)
    expected = tok.decode(out[0], skip_special_tokens=True)[len(tok.decode(ids)) :]
    result = client.completions.create(model="tiny-gpt2", prompt=prompt, max_tokens=10, temperature=0, logprobs=2)
    assert result.object == "text_completion" and result.id.startswith("cmpl-")
    assert result.choices[0].text == expected
    assert result.choices[0].finish_reason in ("stop", "length")
    assert result.usage.prompt_tokens == len(ids)
    assert len(result.choices[0].logprobs.tokens) == result.usage.completion_tokens
    assert "".join(result.choices[0].logprobs.tokens) == expected


def test_openai_client_lists_models_and_aliases(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny-gpt2", "alias-gpt2"]
    assert client.models.retrieve("alias-gpt2").id == "alias-gpt2"
    result = client.completions.create(model="alias-gpt2", prompt=[[5, 6, 7]], max_tokens=2, temperature=0)
    assert result.model == "alias-gpt2"


def test_openai_client_errors_are_typed(client, server):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny-gpt2", prompt="x", max_tokens=2, temperature=5)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="tiny-gpt2", prompt="x", max_tokens=10_000)
    assert long.value.body["code"] == "context_length_exceeded"
    # the server is unharmed
    assert client.completions.create(model="tiny-gpt2", prompt="x", max_tokens=1).usage.completion_tokens == 1
    assert requests.get(server.url + "/health").json() == {"status": "ok"}


def test_timing_headers_and_request_id(server):
    response = requests.post(
        server.url + "/v1/completions",
        headers={"X-Request-ID": "abc-123"},
        json={"model": "tiny-gpt2", "prompt": "Hello", "max_tokens": 4},
    )
    assert response.status_code == 200
    assert response.headers["X-Request-ID"] == "abc-123"
    assert response.json()["id"].startswith("cmpl-")
    for header in ("X-Saker-Queue-Ms", "X-Saker-Prefill-Ms", "X-Saker-Decode-Ms", "X-Saker-Tokens-Per-Second"):
        assert float(response.headers[header]) >= 0
    assert set(response.json()["timing"]) == {
        "queue_ms",
        "prefill_ms",
        "decode_ms",
        "tokens_per_second",
        "cached_prompt_tokens",
        "speculative_draft_tokens",
        "speculative_accepted_tokens",
    }


def test_concurrent_requests_wait_their_turn(server):
    from concurrent.futures import ThreadPoolExecutor

    body = {"model": "tiny-gpt2", "prompt": "Hello", "max_tokens": 8, "temperature": 0}
    with ThreadPoolExecutor(8) as pool:
        results = list(
            pool.map(lambda _: requests.post(server.url + "/v1/completions", json=body, timeout=60), range(16))
        )
    assert all(r.status_code == 200 for r in results)
    assert len({r.json()["choices"][0]["text"] for r in results}) == 1


def test_bad_model_path_fails_at_start_with_one_line(tmp_path):
    srv = Gunicorn({"SAKER_MODEL": str(tmp_path / "missing-model")})
    try:
        srv.proc.wait(120)
    finally:
        srv.stop()
    out = srv.output()
    assert srv.proc.returncode != 0
    assert "does not exist" in out and "missing-model" in out and "Traceback" not in out


def test_engine_process_under_gunicorn(gpt2_dir, reference):
    """SAKER_ENGINE_PROCESS=1 under gunicorn: the openai client's completion, plain and streamed, is
    generate()'s text; stopping gunicorn stops the engine process too."""
    import os

    model, tok = reference(gpt2_dir)
    prompt = "The capital of France is"
    ids = tok(prompt).input_ids
    out = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, pad_token_id=tok.eos_token_id)
    expected = tok.decode(out[0], skip_special_tokens=True)[len(tok.decode(ids)) :]
    srv = Gunicorn(
        {
            "SAKER_MODEL": str(gpt2_dir),
            "SAKER_SERVED_MODEL_NAME": "tiny-gpt2",
            "SAKER_THREADS": "4",
            "SAKER_ENGINE_PROCESS": "1",
        }
    )
    try:
        srv.wait_ready()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        plain = client.completions.create(model="tiny-gpt2", prompt=prompt, max_tokens=10, temperature=0)
        assert plain.choices[0].text == expected
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model="tiny-gpt2", prompt=prompt, max_tokens=10, temperature=0, stream=True
            )
            if c.choices
        )
        assert streamed == expected
        workers = [int(p) for p in Path(f"/proc/{srv.proc.pid}/task/{srv.proc.pid}/children").read_text().split()]
        engines = [int(p) for w in workers for p in Path(f"/proc/{w}/task/{w}/children").read_text().split()]
        assert engines  # the engine process under the gunicorn worker
    finally:
        srv.stop()
    import time

    deadline = time.time() + 10
    while any(os.path.exists(f"/proc/{p}") for p in engines) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(
        os.path.exists(f"/proc/{p}") and "zombie" not in open(f"/proc/{p}/status").read().lower() for p in engines
    )
