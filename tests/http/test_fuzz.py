"""Fuzzing /v1/completions and /v1/chat/completions bodies with hypothesis (Flask test client, tiny models).

Each body mixes plausible values (that reach generation) with wrong types, out-of-range numbers and arbitrary
JSON. Whatever comes in: no 5xx, every error is an OpenAI error object, a stream is well-formed frames ending
in [DONE], and a 200 has the response's shape. Runs are derandomized (the same examples every run) and bounded.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

# strings may hold lone surrogates (JSON's "\ud800"), which are not Unicode
chars = st.characters() | st.characters(categories=["Cs"])
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.integers(-3, 3)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(chars, max_size=12)
)
any_json = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)


def field(plausible) -> st.SearchStrategy:
    """Mostly a plausible value, sometimes anything at all."""
    return st.one_of(plausible, plausible, plausible, any_json)


token_ids = st.lists(st.integers(-3, 450), min_size=0, max_size=8)
text = st.text(chars, max_size=24) | st.sampled_from(["Hello", "Once upon a time", "東京🙂", "", " ", "\n\n"])
stops = st.text(chars, min_size=0, max_size=4) | st.lists(st.text(chars, max_size=4), max_size=6)
tiny = st.floats(0, 1e-4, allow_nan=False, allow_subnormal=True)  # overflow when logits are divided
small_float = st.floats(-3, 3, allow_nan=False) | tiny

COMMON = {
    "max_tokens": field(st.integers(-2, 8) | st.none() | st.integers(200, 10**6)),
    "temperature": field(small_float | st.none()),
    "top_p": field(st.floats(-0.5, 1.5, allow_nan=False)),
    "n": field(st.integers(-1, 3) | st.none()),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({}, optional={"include_usage": field(st.booleans())}) | st.none()),
    "stop": field(stops),
    "presence_penalty": field(small_float),
    "frequency_penalty": field(small_float),
    "logit_bias": field(
        st.dictionaries(
            st.integers(-5, 500).map(str) | st.text(max_size=3), st.floats(-150, 150, allow_nan=False), max_size=3
        )
    ),
    "seed": field(st.integers(-(2**65), 2**65)),
    "user": field(st.text(max_size=8)),
    "top_k": field(st.integers(-3, 60)),
    "min_p": field(st.floats(-0.5, 1.5, allow_nan=False)),
    "repetition_penalty": field(st.floats(-1, 3, allow_nan=False) | tiny | st.floats(50, 1e300)),
    "min_tokens": field(st.integers(-1, 6) | st.none()),
    "ignore_eos": field(st.booleans() | st.none()),
    "stop_token_ids": field(st.lists(st.integers(-2, 500), max_size=3)),
    "include_stop_str_in_output": field(st.booleans()),
    "skip_special_tokens": field(st.booleans()),
}

completion_bodies = st.fixed_dictionaries(
    {"prompt": field(text | token_ids | st.lists(text, max_size=3) | st.lists(token_ids, max_size=3))},
    optional={
        **COMMON,
        "model": field(st.sampled_from(["tiny-gpt2", "gpt2-alias", "nope"])),
        "engine": field(st.sampled_from(["tiny-gpt2", "x"])),
        "suffix": field(st.text(max_size=3) | st.none()),
        "logprobs": field(st.integers(-1, 22) | st.none()),
        "echo": field(st.booleans()),
        "best_of": field(st.integers(-1, 4) | st.none()),
        "some_unknown_field": any_json,
    },
)

part = st.fixed_dictionaries({"type": field(st.just("text")), "text": field(text)})
message = st.fixed_dictionaries(
    {
        "role": field(st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot"])),
        "content": field(text | st.lists(part, max_size=2) | st.none()),
    },
    optional={"name": field(st.text(max_size=5))},
)
chat_bodies = st.fixed_dictionaries(
    {"messages": field(st.lists(message, min_size=0, max_size=3))},
    optional={
        **COMMON,
        "model": field(st.sampled_from(["tiny-llama", "nope"])),
        "max_completion_tokens": field(st.integers(-1, 8) | st.none()),
        "logprobs": field(st.booleans() | st.none()),
        "top_logprobs": field(st.integers(-1, 22) | st.none()),
        "add_generation_prompt": field(st.booleans()),
    },
)


def assert_error_object(body) -> None:
    assert isinstance(body, dict) and list(body) == ["error"], body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], str)


def check(client, url: str, body) -> None:
    resp = client.post(url, data=json.dumps(body), content_type="application/json")
    raw = resp.get_data(as_text=True)
    assert resp.status_code < 500, (resp.status_code, raw, body)
    if resp.status_code >= 400:
        assert resp.mimetype == "application/json", raw
        assert_error_object(json.loads(raw))
        return
    assert resp.status_code == 200
    if resp.mimetype == "text/event-stream":
        frames = raw.split("\n\n")
        assert frames[-1] == "" and frames[-2] == "data: [DONE]", raw
        for frame in frames[:-2]:
            assert frame.startswith("data: "), raw
            chunk = json.loads(frame[len("data: ") :])
            if "error" in chunk:
                assert_error_object(chunk)
                assert chunk["error"]["type"] != "server_error", (chunk, body)
            else:
                assert "choices" in chunk and "id" in chunk
        return
    answer = resp.get_json()
    assert isinstance(answer["choices"], list) and answer["choices"], answer
    assert set(answer["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}


@FUZZ
@given(body=completion_bodies)
def test_fuzz_completions(gpt2_app, body):
    check(gpt2_app.test_client(), "/v1/completions", body)


@FUZZ
@given(body=chat_bodies)
def test_fuzz_chat_completions(llama_app, body):
    check(llama_app.test_client(), "/v1/chat/completions", body)


@FUZZ
@given(body=any_json)
def test_fuzz_arbitrary_json(gpt2_app, body):
    client = gpt2_app.test_client()
    check(client, "/v1/completions", body)
    check(client, "/v1/chat/completions", body)
