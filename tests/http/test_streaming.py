"""Streaming: the concatenated stream equals the non-streamed answer (text and logprob tokens), on both tiny
models, where characters span tokens and stop strings span token boundaries; frame format; errors in-stream."""

from __future__ import annotations

import json
import time

import pytest

from tooling.sse import iter_events


def frames(response) -> list[str]:
    assert response.status_code == 200, response.get_data(as_text=True)
    assert response.mimetype == "text/event-stream"
    assert response.headers["X-Accel-Buffering"] == "no"
    raw = response.get_data(as_text=True)
    assert raw.endswith("data: [DONE]\n\n")
    assert all(part.startswith("data: ") for part in raw.split("\n\n")[:-1]), raw  # one data line a frame
    return [event.data for event in iter_events(raw)]


def stream(client, url, body) -> tuple[list[dict], bool]:
    data = frames(client.post(url, json={**body, "stream": True}))
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]], True


def joined_completion(chunks, index):
    """Text and logprobs of one choice put back together from its chunks; checks finish_reason placement."""
    mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
    assert mine, f"no chunks for choice {index}"
    assert all(c["finish_reason"] is None for c in mine[:-1])
    assert mine[-1]["finish_reason"] in ("stop", "length")
    text = "".join(c["text"] for c in mine)
    lps = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in mine:
        if c["logprobs"]:
            for key in lps:
                lps[key] += c["logprobs"][key]
    return text, lps, mine[-1]["finish_reason"]


BODIES = [
    {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "logprobs": 2},
    {"prompt": "東京は日本 🙂🚀", "max_tokens": 24, "temperature": 0, "logprobs": 1, "echo": True},
    {"prompt": "Hello", "max_tokens": 20, "temperature": 1.0, "seed": 3, "n": 3, "logprobs": 0},
    {"prompt": ["Hello", "The capital"], "max_tokens": 10, "temperature": 0.8, "seed": 9, "n": 2},
    {"prompt": "Hello world", "max_tokens": 0, "echo": True, "logprobs": 3},
    {"prompt": [[5, 6, 7, 8]], "max_tokens": 12, "temperature": 0, "top_k": 5, "repetition_penalty": 1.2},
]


@pytest.mark.parametrize("body", BODIES, ids=range(len(BODIES)))
def test_stream_equals_plain_answer(tiny, body):
    client, _, name = tiny
    body = {**body, "model": name}
    plain = client.post("/v1/completions", json=body).get_json()
    chunks, _ = stream(client, "/v1/completions", body)
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert len({c["id"] for c in chunks}) == 1
    for choice in plain["choices"]:
        text, lps, finish = joined_completion(chunks, choice["index"])
        assert text == choice["text"]
        assert finish == choice["finish_reason"]
        if choice["logprobs"] is not None:
            assert lps == choice["logprobs"]


def _stop_spanning_tokens(client, name, prompt):
    """A stop string made of the last char of one token and the first of the next, from a greedy run."""
    base = client.post(
        "/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 24, "temperature": 0, "logprobs": 0}
    ).get_json()
    tokens = base["choices"][0]["logprobs"]["tokens"]
    for i in range(1, len(tokens) - 1):
        a, b = tokens[i], tokens[i + 1]
        if a and b and (a[-1] + b[0]).strip():
            return a[-1] + b[0], a[-1]
    pytest.skip("no token boundary with text on both sides")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_streams_like_plain(tiny, include):
    client, _, name = tiny
    stop, first_char = _stop_spanning_tokens(client, name, "Once upon a time")
    body = {
        "model": name,
        "prompt": "Once upon a time",
        "max_tokens": 24,
        "temperature": 0,
        "logprobs": 1,
        "stop": [stop, "zzzz"],
        "include_stop_str_in_output": include,
    }
    plain = client.post("/v1/completions", json=body).get_json()
    chunks, _ = stream(client, "/v1/completions", body)
    text, lps, finish = joined_completion(chunks, 0)
    assert finish == plain["choices"][0]["finish_reason"] == "stop"
    assert text == plain["choices"][0]["text"] and lps == plain["choices"][0]["logprobs"]
    assert text.endswith(stop) if include else stop not in text
    if include:  # the held-back first character went out with the rest of the stop string, in the last chunk
        texts = [c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["text"]]
        assert texts[-1].endswith(stop), texts[-3:]
    else:  # never sent: no chunk holds the stop string (the joined text equals the plain one, without it)
        assert all(stop not in c["choices"][0]["text"] for c in chunks if c["choices"])


def test_usage_chunk_and_done(tiny):
    client, _, name = tiny
    body = {
        "model": name,
        "prompt": ["Hello", "Once"],
        "max_tokens": 5,
        "n": 2,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    plain = client.post("/v1/completions", json={**body, "stream_options": None}).get_json()
    chunks, _ = stream(client, "/v1/completions", body)
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == plain["usage"]
    assert all("usage" not in c for c in chunks[:-1])
    assert sorted({c["choices"][0]["index"] for c in chunks[:-1]}) == [0, 1, 2, 3]
    without, _ = stream(client, "/v1/completions", {**body, "stream_options": None})
    assert all("usage" not in c for c in without)


@pytest.mark.parametrize(
    "url,extra",
    [
        ("/v1/completions", {"prompt": ["Hello", "Once"]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ],
)
def test_continuous_usage_stats_count_up_on_every_chunk(tiny, url, extra):
    """stream_options.continuous_usage_stats (vLLM): every chunk carries usage so far; the counts never go down,
    and the last content chunk's completion_tokens equal the plain answer's."""
    client, _, name = tiny
    if "messages" in extra and name == "tiny-gpt2":
        pytest.skip("the tiny GPT-2 has no chat template (the tiny Llama's case covers chat)")
    body = {
        "model": name,
        "max_tokens": 5,
        "n": 2,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    plain = client.post(url, json={**body, "stream_options": None}).get_json()
    chunks, _ = stream(client, url, body)
    assert all("usage" in c for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == plain["usage"]["completion_tokens"]
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {plain["usage"]["prompt_tokens"]}
    assert all(
        c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"] for c in chunks
    )


def test_continuous_usage_stats_without_include_usage_sends_no_usage(llama_client):
    """vLLM's semantics: continuous_usage_stats counts only with include_usage; without it no chunk has usage."""
    body = {
        "model": "tiny-llama",
        "prompt": "Hello",
        "max_tokens": 4,
        "temperature": 0,
        "stream_options": {"include_usage": False, "continuous_usage_stats": True},
    }
    chunks, _ = stream(llama_client, "/v1/completions", body)
    assert chunks and all("usage" not in c or c["usage"] is None for c in chunks)
    assert all(c["choices"] for c in chunks)  # and no usage-only chunk at the end


def test_error_after_the_stream_began_is_a_frame(llama_client, llama_app, monkeypatch):
    runner = llama_app.extensions["saker.service"].worker.runner
    calls = {"n": 0}
    real = runner.rows_step

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "rows_step", failing)
    body = {"model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    data = frames(llama_client.post("/v1/completions", json={**body, "stream": True}))
    assert data[-1] == "[DONE]"
    error = json.loads(data[-2])
    assert set(error) == {"error"} and error["error"]["type"] == "server_error"
    assert "request id" in error["error"]["message"] and "injected" not in error["error"]["message"]
    assert any(json.loads(d).get("choices") for d in data[:-2])  # text was streamed before the fault
    monkeypatch.setattr(runner, "rows_step", real)
    # the worker is free and serving
    assert llama_client.post("/v1/completions", json=body).status_code == 200


def test_validation_errors_come_before_the_stream(gpt2_client):
    response = gpt2_client.post(
        "/v1/completions", json={"model": "tiny-gpt2", "prompt": "x", "stream": True, "max_tokens": 10_000}
    )
    assert response.status_code == 400
    assert response.get_json()["error"]["code"] == "context_length_exceeded"
    response = gpt2_client.post("/v1/completions", json={"prompt": "x", "stream": True, "best_of": 3})
    assert response.status_code == 400 and response.get_json()["error"]["param"] == "best_of"


def test_closing_a_stream_early_frees_the_worker(gpt2_app):
    """Closing the response iterator (what a WSGI server does when the client goes away) stops generation."""
    client = gpt2_app.test_client()
    worker = gpt2_app.extensions["saker.service"].worker
    response = client.post(
        "/v1/completions",
        json={"prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True, "temperature": 0},
        buffered=False,
    )
    iterator = iter(response.response)
    first = next(iterator)
    assert first.startswith(b"data: ") or first.startswith("data: ")
    assert worker.queue_snapshot()["active"] == 1
    response.close()
    deadline = time.time() + 30  # a safety net: the scheduler's next step drops it
    while worker.queue_snapshot()["active"] and time.time() < deadline:
        time.sleep(0.01)
    assert worker.queue_snapshot()["active"] == 0, "the cancelled request gave its slot back"
    assert not worker.engine.batch.groups, "the scheduler dropped the cancelled request"
    assert client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).status_code == 200
