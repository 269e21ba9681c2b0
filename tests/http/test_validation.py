"""Every validation rule of POST /v1/completions: a bad input answers a clean OpenAI error naming the field,
and the server keeps serving afterwards.

The tiny GPT-2 (``gpt2_client``) has a ~400-token vocabulary, 256 positions, no BOS token (an empty string
encodes to nothing) and is served as ``tiny-gpt2`` with the alias ``gpt2-alias``. Server limits are the
defaults: max_n = max_best_of = 128, max_logprobs = 20, max_stop_sequences = 4.
"""

from __future__ import annotations

import json

import pytest

URL = "/v1/completions"
GOOD = {"model": "tiny-gpt2", "prompt": "Hello world", "max_tokens": 1, "temperature": 0}
DROP = object()  # marks a field to remove from GOOD
FAR = 100_000  # far outside the tiny vocabulary
CONTEXT = 256  # n_positions of the tiny GPT-2


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def request_with(**changes) -> dict:
    body = dict(GOOD)
    for key, value in changes.items():
        if value is DROP:
            body.pop(key, None)
        else:
            body[key] = value
    return body


def assert_error(
    resp, status: int, param: str | None, code: str | None = None, type_: str = "invalid_request_error"
) -> dict:
    body = resp.get_json(silent=True)
    assert resp.status_code == status, (resp.status_code, resp.get_data(as_text=True))
    assert resp.mimetype == "application/json"
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == type_, err
    assert err["param"] == param, err
    assert err["code"] == code, err
    assert isinstance(err["message"], str) and err["message"].strip(), err
    assert "Traceback" not in err["message"]
    if param is not None:
        assert param in err["message"], err
    return err


def assert_still_serving(client) -> None:
    resp = client.post(URL, json=GOOD)
    assert resp.status_code == 200, resp.get_data(as_text=True)
    body = resp.get_json()
    assert body["object"] == "text_completion" and len(body["choices"]) == 1
    assert body["usage"]["completion_tokens"] == 1


# (id, changes to GOOD, param); every one is a 400 invalid_request_error with code null
BAD_FIELDS = [
    # -- prompt -------------------------------------------------------------------------------------------
    ("prompt-missing", {"prompt": DROP}, "prompt"),
    ("prompt-null", {"prompt": None}, "prompt"),
    ("prompt-dict", {"prompt": {"text": "hi"}}, "prompt"),
    ("prompt-number", {"prompt": 5}, "prompt"),
    ("prompt-float", {"prompt": 1.5}, "prompt"),
    ("prompt-bool", {"prompt": True}, "prompt"),
    ("prompt-mixed-str-int", {"prompt": ["a", 1]}, "prompt"),
    ("prompt-mixed-int-str", {"prompt": [1, "a"]}, "prompt"),
    ("prompt-mixed-ids-and-list", {"prompt": [1, [2, 3]]}, "prompt"),
    ("prompt-empty-list", {"prompt": []}, "prompt"),
    ("prompt-empty-inner-list", {"prompt": [[]]}, "prompt"),
    ("prompt-one-empty-inner-list", {"prompt": [[1, 2], []]}, "prompt"),
    ("prompt-inner-str", {"prompt": [[1, "a"]]}, "prompt"),
    ("prompt-too-deep", {"prompt": [[[1]]]}, "prompt"),
    ("prompt-float-ids", {"prompt": [1.5, 2.0]}, "prompt"),
    ("prompt-bool-ids", {"prompt": [True, False]}, "prompt"),
    ("prompt-null-item", {"prompt": ["a", None]}, "prompt"),
    ("prompt-id-negative", {"prompt": [-1]}, "prompt"),
    ("prompt-id-outside-vocab", {"prompt": [1, FAR]}, "prompt"),
    ("prompt-id-huge", {"prompt": [10**30]}, "prompt"),
    ("prompt-ids-second-bad", {"prompt": [[1, 2], [FAR]]}, "prompt"),
    # -- model ----------------------------------------------------------------------------------------
    ("model-number", {"model": 5}, "model"),
    ("model-list", {"model": ["tiny-gpt2"]}, "model"),
    # -- temperature / top_p / penalties / min_p / repetition_penalty / top_k ----------------------------
    ("temperature-negative", {"temperature": -0.1}, "temperature"),
    ("temperature-over-2", {"temperature": 2.01}, "temperature"),
    ("temperature-string", {"temperature": "1"}, "temperature"),
    ("temperature-bool", {"temperature": True}, "temperature"),
    ("temperature-list", {"temperature": [1]}, "temperature"),
    ("top_p-negative", {"top_p": -0.1}, "top_p"),
    ("top_p-over-1", {"top_p": 1.01}, "top_p"),
    ("top_p-string", {"top_p": "0.5"}, "top_p"),
    ("top_p-bool", {"top_p": True}, "top_p"),
    ("presence_penalty-low", {"presence_penalty": -2.01}, "presence_penalty"),
    ("presence_penalty-high", {"presence_penalty": 2.01}, "presence_penalty"),
    ("presence_penalty-string", {"presence_penalty": "1"}, "presence_penalty"),
    ("presence_penalty-bool", {"presence_penalty": False}, "presence_penalty"),
    ("frequency_penalty-low", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("frequency_penalty-high", {"frequency_penalty": 3}, "frequency_penalty"),
    ("frequency_penalty-string", {"frequency_penalty": "0"}, "frequency_penalty"),
    ("frequency_penalty-bool", {"frequency_penalty": True}, "frequency_penalty"),
    ("min_p-negative", {"min_p": -0.01}, "min_p"),
    ("min_p-over-1", {"min_p": 1.01}, "min_p"),
    ("min_p-string", {"min_p": "0.1"}, "min_p"),
    ("min_p-bool", {"min_p": True}, "min_p"),
    ("repetition_penalty-zero", {"repetition_penalty": 0}, "repetition_penalty"),
    ("repetition_penalty-negative", {"repetition_penalty": -1.0}, "repetition_penalty"),
    ("repetition_penalty-string", {"repetition_penalty": "1.1"}, "repetition_penalty"),
    ("repetition_penalty-bool", {"repetition_penalty": True}, "repetition_penalty"),
    ("top_k-below-minus-1", {"top_k": -2}, "top_k"),
    ("top_k-float", {"top_k": 1.5}, "top_k"),
    ("top_k-string", {"top_k": "5"}, "top_k"),
    ("top_k-bool", {"top_k": True}, "top_k"),
    # -- n / best_of ------------------------------------------------------------------------------------
    ("n-zero", {"n": 0}, "n"),
    ("n-negative", {"n": -1}, "n"),
    ("n-over-max", {"n": 129}, "n"),
    ("n-float", {"n": 1.5}, "n"),
    ("n-string", {"n": "2"}, "n"),
    ("n-bool", {"n": True}, "n"),
    ("best_of-zero", {"best_of": 0}, "best_of"),
    ("best_of-over-max", {"best_of": 129}, "best_of"),
    ("best_of-below-n", {"n": 3, "best_of": 2}, "best_of"),
    ("best_of-string", {"best_of": "2"}, "best_of"),
    ("best_of-bool", {"best_of": True}, "best_of"),
    # -- logprobs ---------------------------------------------------------------------------------------
    ("logprobs-negative", {"logprobs": -1}, "logprobs"),
    ("logprobs-over-max", {"logprobs": 21}, "logprobs"),
    ("logprobs-bool", {"logprobs": True}, "logprobs"),
    ("logprobs-string", {"logprobs": "1"}, "logprobs"),
    ("logprobs-float", {"logprobs": 1.5}, "logprobs"),
    # -- max_tokens / min_tokens --------------------------------------------------------------------------
    ("max_tokens-negative", {"max_tokens": -1}, "max_tokens"),
    ("max_tokens-float", {"max_tokens": 1.5}, "max_tokens"),
    ("max_tokens-string", {"max_tokens": "16"}, "max_tokens"),
    ("max_tokens-bool", {"max_tokens": True}, "max_tokens"),
    ("min_tokens-over-max_tokens", {"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ("min_tokens-negative", {"min_tokens": -1}, "min_tokens"),
    ("min_tokens-string", {"min_tokens": "1"}, "min_tokens"),
    # -- stop -------------------------------------------------------------------------------------------
    ("stop-too-many", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("stop-empty-string", {"stop": ""}, "stop"),
    ("stop-list-with-empty", {"stop": ["a", ""]}, "stop"),
    ("stop-number", {"stop": 5}, "stop"),
    ("stop-list-of-numbers", {"stop": [1]}, "stop"),
    ("stop-dict", {"stop": {"a": 1}}, "stop"),
    ("stop-nested-list", {"stop": [["a"]]}, "stop"),
    # -- logit_bias -------------------------------------------------------------------------------------
    ("logit_bias-word-key", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("logit_bias-float-key", {"logit_bias": {"1.5": 1}}, "logit_bias"),
    ("logit_bias-spaced-key", {"logit_bias": {" 1": 1}}, "logit_bias"),
    ("logit_bias-superscript-key", {"logit_bias": {"\u00b2": 1}}, "logit_bias"),  # "²".isdigit() is True
    ("logit_bias-outside-vocab", {"logit_bias": {str(FAR): 1}}, "logit_bias"),
    ("logit_bias-negative-id", {"logit_bias": {"-1": 5}}, "logit_bias"),
    ("logit_bias-5000-digit-key", {"logit_bias": {"7" * 5000: 1}}, "logit_bias"),  # int() refuses 4300+
    ("logit_bias-over-100", {"logit_bias": {"1": 101}}, "logit_bias"),
    ("logit_bias-under-minus-100", {"logit_bias": {"1": -100.5}}, "logit_bias"),
    ("logit_bias-string-value", {"logit_bias": {"1": "x"}}, "logit_bias"),
    ("logit_bias-bool-value", {"logit_bias": {"1": True}}, "logit_bias"),
    ("logit_bias-null-value", {"logit_bias": {"1": None}}, "logit_bias"),
    ("logit_bias-list", {"logit_bias": [1, 2]}, "logit_bias"),
    ("logit_bias-string", {"logit_bias": "1:5"}, "logit_bias"),
    # -- response_format and structured_outputs (tests/http/test_structured_outputs.py has the grammar's own) -------
    ("response_format-unknown-type", {"response_format": {"type": "sound"}}, "response_format"),
    ("response_format-not-an-object", {"response_format": "json"}, "response_format"),
    ("response_format-json_schema-missing", {"response_format": {"type": "json_schema"}}, "response_format"),
    (
        "response_format-schema-not-object",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
        "response_format",
    ),
    (
        "response_format-bad-name",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {"type": "object"}}}},
        "response_format",
    ),
    (
        "response_format-llama.cpp-schema-123",
        {"response_format": {"type": "json_object", "schema": 123}},
        "response_format",
    ),
    (
        "response_format-bad-schema-type",
        {"response_format": {"type": "json_object", "schema": {"type": 123}}},
        "response_format",
    ),
    (
        "response_format-schema-hiccup",
        {"response_format": {"type": "json_object", "schema": {"type": "hiccup"}}},
        "response_format",
    ),
    ("structured_outputs-two-kinds", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("structured_outputs-none", {"structured_outputs": {}}, "structured_outputs"),
    ("structured_outputs-bad-regex", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ("structured_outputs-empty-choice", {"structured_outputs": {"choice": []}}, "structured_outputs"),
    ("structured_outputs-choice-empty-string", {"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs"),
    ("structured_outputs-json-text-not-json", {"structured_outputs": {"json": "{oops"}}, "structured_outputs"),
    (
        "structured_outputs-bad-grammar",
        {"structured_outputs": {"grammar": "start: undefined_rule"}},
        "structured_outputs",
    ),
    ("structured_outputs-structural_tag", {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    (
        "structured_outputs-and-response_format",
        {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
        "structured_outputs",
    ),
    (
        "structured_outputs-with-allowed_token_ids",
        {"structured_outputs": {"regex": "a"}, "allowed_token_ids": [1, 2]},
        "allowed_token_ids",
    ),
    # -- allowed_token_ids, logprobs_mode, seed ---------------------------------------------------------
    ("allowed_token_ids-outside-vocab", {"allowed_token_ids": [1, FAR]}, "allowed_token_ids"),
    ("allowed_token_ids-empty", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("allowed_token_ids-strings", {"allowed_token_ids": ["1"]}, "allowed_token_ids"),
    ("logprobs_mode-unknown", {"logprobs_mode": "raw_logits"}, "logprobs_mode"),
    ("seed-above-int64", {"seed": 2**63}, "seed"),
    ("seed-below-int64", {"seed": -(2**63) - 1}, "seed"),
    # -- stop_token_ids ---------------------------------------------------------------------------------
    ("stop_token_ids-outside-vocab", {"stop_token_ids": [FAR]}, "stop_token_ids"),
    ("stop_token_ids-negative", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("stop_token_ids-string", {"stop_token_ids": "x"}, "stop_token_ids"),
    ("stop_token_ids-number", {"stop_token_ids": 5}, "stop_token_ids"),
    ("stop_token_ids-float", {"stop_token_ids": [1.5]}, "stop_token_ids"),
    ("stop_token_ids-bool", {"stop_token_ids": [True]}, "stop_token_ids"),
    # -- suffix / stream ------------------------------------------------------------------------------------
    ("suffix", {"suffix": "the end"}, "suffix"),
    ("suffix-number", {"suffix": 5}, "suffix"),
    ("stream-best_of", {"stream": True, "n": 1, "best_of": 2}, "best_of"),
    (
        "stream_options-include_usage-string",
        {"stream": True, "stream_options": {"include_usage": "yes"}},
        "stream_options",
    ),
    ("stream-string", {"stream": "yes"}, "stream"),
    ("stream_options-without-stream", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("stream_options-stream-false", {"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    ("stream_options-not-object", {"stream_options": "usage"}, "stream_options"),
    # -- other types --------------------------------------------------------------------------------------
    ("echo-string", {"echo": "yes"}, "echo"),
    ("echo-number", {"echo": 1}, "echo"),
    ("seed-string", {"seed": "1"}, "seed"),
    ("seed-float", {"seed": 1.5}, "seed"),
    ("user-number", {"user": 5}, "user"),
    ("ignore_eos-string", {"ignore_eos": "yes"}, "ignore_eos"),
    ("include_stop_str_in_output-number", {"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ("skip_special_tokens-string", {"skip_special_tokens": "no"}, "skip_special_tokens"),
]


@pytest.mark.parametrize("changes,param", [pytest.param(c, p, id=i) for i, c, p in BAD_FIELDS])
def test_bad_field_is_400_naming_it(gpt2_client, changes, param):
    resp = gpt2_client.post(URL, json=request_with(**changes))
    assert_error(resp, 400, param)
    assert_still_serving(gpt2_client)


# -- vocabulary edges (the exact vocabulary size comes from the tokenizer, not from the server) ------------
@pytest.fixture(scope="module")
def vocab_size(gpt2_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(gpt2_dir).vocab_size


@pytest.mark.parametrize("field", ["prompt", "logit_bias", "stop_token_ids"])
def test_token_id_vocab_boundary(gpt2_client, vocab_size, field):
    def body(token):
        value = {"prompt": [1, token], "logit_bias": {str(token): 1}, "stop_token_ids": [token]}[field]
        return request_with(**{field: value})

    assert gpt2_client.post(URL, json=body(vocab_size - 1)).status_code == 200
    assert_error(gpt2_client.post(URL, json=body(vocab_size)), 400, field)
    assert_still_serving(gpt2_client)


# -- non-JSON numbers ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field,literal",
    [
        ("temperature", "NaN"),
        ("top_p", "NaN"),
        ("repetition_penalty", "Infinity"),
        ("presence_penalty", "-Infinity"),
        ("logit_bias", '{"1": NaN}'),
    ],
)
def test_nan_and_infinity_are_rejected(gpt2_client, field, literal):
    """NaN/Infinity are not JSON (RFC 8259), although Python's parser takes them; they must never reach the
    sampler (an infinite repetition_penalty passes a plain ``> 0`` check)."""
    raw = json.dumps(GOOD)[:-1] + f', "{field}": {literal}}}'
    resp = gpt2_client.post(URL, data=raw, content_type="application/json")
    assert resp.status_code == 400, resp.get_data(as_text=True)
    err = resp.get_json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] in (field, None)
    assert_still_serving(gpt2_client)


@pytest.mark.parametrize(
    "field",
    ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"],
)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_numbers_rejected_by_the_schema(field, value):
    """The same rule for callers that parse JSON themselves (the batch CLI reads JSONL with json.loads)."""
    from app.errors import InvalidRequestError
    from app.protocol import CompletionRequest, parse_request

    body = {"prompt": "x", field: {"1": value} if field == "logit_bias" else value}
    with pytest.raises(InvalidRequestError) as info:
        parse_request(CompletionRequest, body)
    assert info.value.param == field and info.value.status == 400


# -- model ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "changes",
    [{"model": "no-such-model"}, {"model": DROP, "engine": "no-such-model"}, {"model": "TINY-GPT2"}],
    ids=["model", "engine", "case-sensitive"],
)
def test_unknown_model_is_404(gpt2_client, changes):
    resp = gpt2_client.post(URL, json=request_with(**changes))
    err = assert_error(resp, 404, "model", code="model_not_found")
    assert "tiny-gpt2" in err["message"]  # says what is served
    assert_still_serving(gpt2_client)


@pytest.mark.parametrize(
    "changes,reported",
    [
        ({"model": DROP, "engine": "tiny-gpt2"}, "tiny-gpt2"),
        ({"model": DROP, "engine": "gpt2-alias"}, "gpt2-alias"),
        ({"model": "gpt2-alias"}, "gpt2-alias"),
        ({"model": DROP}, "tiny-gpt2"),
        ({"model": None}, "tiny-gpt2"),
    ],
    ids=["engine", "engine-alias", "alias", "no-model", "null-model"],
)
def test_engine_alias_and_default_model(gpt2_client, changes, reported):
    resp = gpt2_client.post(URL, json=request_with(**changes))
    assert resp.status_code == 200, resp.get_data(as_text=True)
    assert resp.get_json()["model"] == reported


# -- context length ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prompt_len,max_tokens,param",
    [
        (CONTEXT - 5, 6, "max_tokens"),  # 251 + 6 = 257 > 256
        (10, CONTEXT, "max_tokens"),  # 10 + 256
        (CONTEXT + 1, 0, "prompt"),  # the prompt alone is too long
        (CONTEXT, None, "prompt"),  # null max_tokens needs room for at least one token
    ],
)
def test_context_length_exceeded(gpt2_client, prompt_len, max_tokens, param):
    resp = gpt2_client.post(URL, json=request_with(prompt=[5] * prompt_len, max_tokens=max_tokens))
    assert_error(resp, 400, param, code="context_length_exceeded")
    assert_still_serving(gpt2_client)


def test_context_length_exceeded_string_and_batch(gpt2_client):
    long_text = "The capital of France is Paris. " * 60  # far more than 256 tokens
    assert_error(
        gpt2_client.post(URL, json=request_with(prompt=long_text)), 400, "prompt", code="context_length_exceeded"
    )
    assert_error(
        gpt2_client.post(URL, json=request_with(prompt=["short", long_text])),
        400,
        "prompt",
        code="context_length_exceeded",
    )
    assert_still_serving(gpt2_client)


def test_prompt_filling_context_exactly(gpt2_client):
    resp = gpt2_client.post(URL, json=request_with(prompt=[5] * (CONTEXT - 1), max_tokens=1))
    assert resp.status_code == 200, resp.get_data(as_text=True)
    assert resp.get_json()["usage"] == {"prompt_tokens": 255, "completion_tokens": 1, "total_tokens": 256}
    resp = gpt2_client.post(URL, json=request_with(prompt=[5] * CONTEXT, max_tokens=0, echo=True))
    assert resp.status_code == 200, resp.get_data(as_text=True)
    assert resp.get_json()["usage"]["completion_tokens"] == 0


def test_max_tokens_null_runs_to_the_context(gpt2_client):
    resp = gpt2_client.post(URL, json=request_with(prompt=[5] * (CONTEXT - 4), max_tokens=None, ignore_eos=True))
    assert resp.status_code == 200, resp.get_data(as_text=True)
    body = resp.get_json()
    assert body["usage"] == {"prompt_tokens": 252, "completion_tokens": 4, "total_tokens": 256}
    assert body["choices"][0]["finish_reason"] == "length"
    resp = gpt2_client.post(URL, json=request_with(max_tokens=None))
    assert resp.status_code == 200
    assert resp.get_json()["usage"]["total_tokens"] <= CONTEXT


# -- what is accepted -----------------------------------------------------------------------------------
ACCEPTED = [
    ("unknown-fields", {"foo": 1, "metadata": [1, 2], "service_tier": None}),
    ("response_format-text", {"response_format": {"type": "text"}}),
    ("response_format-json_object", {"response_format": {"type": "json_object"}}),
    (
        "response_format-json_schema-no-name",
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"const": "42"}}}},
    ),
    ("structured_outputs-json-as-text", {"structured_outputs": {"json": '{"type": "integer"}'}}),
    ("temperature-int", {"temperature": 1, "seed": 1}),
    ("temperature-2", {"temperature": 2, "seed": 1}),
    ("top_p-0", {"top_p": 0, "temperature": 1, "seed": 1}),
    ("top_k-0-and-minus-1", {"top_k": 0}),
    ("top_k-minus-1", {"top_k": -1, "temperature": 1, "seed": 2}),
    ("penalties-at-bounds", {"presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 1.5}),
    ("min_p-1", {"min_p": 1.0, "temperature": 1, "seed": 1}),
    ("logit_bias-bounds", {"logit_bias": {"1": 100, "2": -100, "3": 0.5}}),
    ("stop-max-count", {"stop": ["a", "b", "c", "d"]}),
    ("stop-string", {"stop": "\n"}),
    ("stop-empty-list", {"stop": []}),
    ("n-and-best_of-max", {"n": 20, "best_of": 20, "temperature": 1, "seed": 3}),
    ("n-128-openai-max", {"n": 128, "max_tokens": 2, "temperature": 1, "seed": 3}),
    ("logprobs-0-and-max", {"logprobs": 20}),
    ("logprobs-0", {"logprobs": 0}),
    ("max_tokens-0", {"max_tokens": 0}),
    ("min_tokens-equal-max", {"min_tokens": 1, "max_tokens": 1}),
    ("suffix-empty", {"suffix": ""}),
    ("suffix-null", {"suffix": None}),
    ("stream-false", {"stream": False}),
    ("prompt-empty-string", {"prompt": ""}),  # conditioned on the start token, as OpenAI does
    ("prompt-list-empty-string", {"prompt": [""]}),
    ("prompt-list-second-empty", {"prompt": ["ok", ""]}),
    ("seed-int64-extremes", {"seed": -(2**63), "temperature": 1}),
    ("seed-int64-max", {"seed": 2**63 - 1, "temperature": 1}),
    ("user", {"user": "someone"}),
    ("token-id-prompt", {"prompt": [1, 2, 3]}),
    ("token-id-prompts", {"prompt": [[1, 2], [3]]}),
    ("string-prompts", {"prompt": ["a", "b c"]}),
]


@pytest.mark.parametrize("changes", [pytest.param(c, id=i) for i, c in ACCEPTED])
def test_accepted(gpt2_client, changes):
    resp = gpt2_client.post(URL, json=request_with(**changes))
    assert resp.status_code == 200, resp.get_data(as_text=True)
    assert resp.get_json()["object"] == "text_completion"


# OpenAI documents these as nullable: null means the default (clients such as LangChain send explicit nulls)
NULLABLE = [
    "temperature",
    "top_p",
    "n",
    "stream",
    "logprobs",
    "echo",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "best_of",
    "logit_bias",
    "seed",
    "user",
    "suffix",
    "stream_options",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "logprobs_mode",
]


@pytest.mark.parametrize("field", NULLABLE)
def test_null_means_default(gpt2_client, field):
    resp = gpt2_client.post(URL, json=request_with(**{field: None}))
    assert resp.status_code == 200, resp.get_data(as_text=True)
    body = resp.get_json()
    assert len(body["choices"]) == 1 and body["choices"][0]["logprobs"] is None
    assert body["usage"]["completion_tokens"] == 1


def test_every_logit_bias_key_outside_the_vocabulary_is_named(gpt2_client):
    keys = [str(FAR + i) for i in range(10)]
    body = assert_error(
        gpt2_client.post(URL, json=request_with(logit_bias={**{k: 1 for k in keys}, "5": 1})), 400, "logit_bias"
    )
    message = body if isinstance(body, str) else body.get("message", "")
    assert all(k in message for k in keys[:8]) and "and 2 more" in message and " 5," not in message


def test_every_malformed_logit_bias_entry_is_named(gpt2_client):
    """Several bad keys and values in one logit_bias: the message names each of them, not only the first."""
    bias = {"abc": 1, "1.5": 1, "7": 101, "9": -300, "3": 2}
    message = assert_error(gpt2_client.post(URL, json=request_with(logit_bias=bias)), 400, "logit_bias")["message"]
    assert all(part in message for part in ("'abc'", "'1.5'", "101.0 for 7", "-300.0 for 9")), message
    assert "for 3" not in message


def test_logprobs_above_the_vocabulary_are_400_whatever_the_cap(gpt2_dir, gpt2_worker):
    """SAKER_MAX_LOGPROBS may be raised past 20; a k above the vocabulary is still a 400, not a crash."""
    from app import create_app
    from conftest import make_settings

    client = create_app(
        make_settings(model=str(gpt2_dir), served_model_name="tiny-gpt2", max_logprobs=100_000), worker=gpt2_worker
    ).test_client()
    vocab = gpt2_worker.info.vocab_size
    ok = client.post(URL, json=request_with(logprobs=vocab, max_tokens=1))
    assert ok.status_code == 200 and len(ok.get_json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= vocab - 1
    assert_error(client.post(URL, json=request_with(logprobs=vocab + 1)), 400, "logprobs")
    chat = client.post(
        "/v1/chat/completions",
        json={
            "model": "tiny-gpt2",
            "messages": [{"role": "user", "content": "x"}],
            "logprobs": True,
            "top_logprobs": vocab + 5,
        },
    )
    assert chat.status_code == 400 and chat.get_json()["error"]["param"] in ("top_logprobs", "messages")
    assert client.post(URL, json=GOOD).status_code == 200
