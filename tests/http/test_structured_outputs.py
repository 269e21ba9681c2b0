"""Structured outputs on the tiny models: greedy constrained output equals a plain forward loop that applies
llguidance's masks itself (not our sampler), batched equals alone, logprobs stay raw, an output cut by
max_tokens says ``length``, choice and regex outputs match. The 20+ schema corpus on the embedded SmolLM2 is in
test_structured_outputs_smollm2.py."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch

from app.engine.sampling.json_schemas import json_options  # the served grammar's JSON layout (the whitespace it allows)
from tooling.sse import iter_json
from conftest import make_settings

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def reference_constrained(model, tok, grammar: str, prompt_ids: list[int], max_new: int) -> tuple[list[int], bool]:
    """Greedy decoding with a full forward per token and llguidance's own bitmask applied to the logits:
    (tokens, whether the grammar completed)."""
    vocab = model.get_output_embeddings().weight.shape[0]
    eos = [tok.eos_token_id]
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos), grammar)
    assert not matcher.is_error(), matcher.get_error()
    ids, out = list(prompt_ids), []
    for _ in range(max_new):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")[:vocab]
        logits[torch.from_numpy(bits == 0)] = float("-inf")
        token = int(logits.argmax())
        if token in eos:
            return out, True
        out.append(token)
        ids.append(token)
        assert matcher.consume_token(token)
        if matcher.is_stopped():
            return out, True
    return out, False


def complete(client, model_name, **body):
    resp = client.post("/v1/completions", json={"model": model_name, "temperature": 0, **body})
    assert resp.status_code == 200, resp.get_data(as_text=True)
    return resp.get_json()


GRAMMARS = {
    "json_schema": (
        {"structured_outputs": {"json": PERSON}},
        lambda: llguidance.LLMatcher.grammar_from_json_schema(PERSON, defaults=json_options()),
    ),
    "response_format": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
        lambda: llguidance.LLMatcher.grammar_from_json_schema(PERSON, defaults=json_options()),
    ),
    "regex": (
        {"structured_outputs": {"regex": r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"}},
        lambda: llguidance.LLMatcher.grammar_from_regex(r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"),
    ),
    "lark": (
        {"structured_outputs": {"grammar": 'start: "x" NUM ("," NUM)*\nNUM: /[0-9]{1,3}/'}},
        lambda: llguidance.LLMatcher.grammar_from_lark('start: "x" NUM ("," NUM)*\nNUM: /[0-9]{1,3}/'),
    ),
}


@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_greedy_equals_a_plain_loop_with_the_librarys_masks(tiny, reference, kind):
    client, path, name = tiny
    model, tok = reference(path)
    fields, grammar = GRAMMARS[kind]
    prompt = "Hello world"
    want, completed = reference_constrained(model, tok, grammar(), tok(prompt)["input_ids"], 40)
    got = complete(client, name, prompt=prompt, max_tokens=40, **fields)["choices"][0]
    assert got["text"] == tok.decode(want, skip_special_tokens=True)
    assert got["finish_reason"] == ("stop" if completed else "length")


def test_outputs_match_their_constraint(gpt2_client):
    pattern = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    body = complete(
        gpt2_client,
        "tiny-gpt2",
        prompt="Mail:",
        max_tokens=40,
        n=4,
        temperature=1.0,
        seed=3,
        structured_outputs={"regex": pattern},
    )
    for choice in body["choices"]:
        assert re.fullmatch(pattern, choice["text"]) and choice["finish_reason"] == "stop", choice
    choices = ["positive", "negative", "neutral ✓"]
    body = complete(
        gpt2_client,
        "tiny-gpt2",
        prompt="Sentiment:",
        max_tokens=20,
        n=6,
        temperature=1.5,
        seed=1,
        structured_outputs={"choice": choices},
    )
    assert {c["text"] for c in body["choices"]} <= set(choices)
    assert all(c["finish_reason"] == "stop" for c in body["choices"])


@pytest.fixture(scope="module")
def compact_client(gpt2_dir, gpt2_worker):
    """JSON grammars without free whitespace (``json_whitespace=""``): a random tiny model writes whitespace
    wherever a grammar allows it, and these tests are about what it writes between."""
    from app import create_app

    return create_app(
        make_settings(model=str(gpt2_dir), served_model_name="tiny-gpt2", json_whitespace=""), worker=gpt2_worker
    ).test_client()


def test_json_object_and_schemas_parse(compact_client):
    import jsonschema

    for fields in (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
        {"response_format": {"type": "json_object", "schema": {"const": "42"}}},
        {"structured_outputs": {"json": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4}}},
    ):
        body = complete(
            compact_client, "tiny-gpt2", prompt="JSON:", max_tokens=80, n=3, temperature=1.0, seed=5, **fields
        )
        schema = (
            fields.get("structured_outputs", {}).get("json")
            or fields["response_format"].get("schema")
            or fields["response_format"]["json_schema"]["schema"]
        )
        for choice in body["choices"]:
            assert choice["finish_reason"] == "stop", choice
            jsonschema.validate(json.loads(choice["text"]), schema)


def test_length_inside_the_json_is_reported_as_such(gpt2_client):
    body = complete(
        gpt2_client,
        "tiny-gpt2",
        prompt="JSON:",
        max_tokens=3,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["text"].startswith("{") and body["usage"]["completion_tokens"] == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice["text"])


def test_logprobs_stay_raw_under_the_mask(gpt2_client, gpt2_dir, reference):
    """The reported logprob of each chosen token is the model's own (a plain forward's log-softmax), not the
    renormalized masked distribution."""
    from references import ref_logprobs

    model, tok = reference(gpt2_dir)
    body = complete(
        gpt2_client,
        "tiny-gpt2",
        prompt="Sentiment:",
        max_tokens=8,
        logprobs=2,
        structured_outputs={"choice": ["positive", "negative"]},
    )
    choice = body["choices"][0]
    prompt_ids = tok("Sentiment:")["input_ids"]
    ids = prompt_ids + tok(choice["text"])["input_ids"]
    lp = ref_logprobs(model, ids)
    chosen = choice["logprobs"]["token_logprobs"]
    for k, value in enumerate(chosen):
        position = len(prompt_ids) + k
        assert value == pytest.approx(lp[position - 1, ids[position]].item(), abs=1e-4)
    assert sum(np.exp(chosen)) < len(chosen) - 1e-3  # masked renormalized logprobs would all be near 0


def test_constrained_and_free_rows_share_a_batch_unchanged(gpt2_client):
    """Requests run one at a time, then all at once (they share decode steps): the same texts."""
    bodies = [
        dict(prompt="Mail:", max_tokens=30, structured_outputs={"regex": r"[a-z]{2,6}@[a-z]{2,5}\.com"}),
        dict(prompt="Hello world", max_tokens=30),
        dict(
            prompt="JSON:",
            max_tokens=40,
            temperature=1.0,
            seed=11,
            n=2,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        ),
        dict(prompt="Once upon a time", max_tokens=30, temperature=0.9, seed=4),
        dict(prompt="Pick:", max_tokens=10, structured_outputs={"choice": ["red", "green", "blue"]}),
    ]

    def texts(body):
        return [c["text"] for c in complete(gpt2_client, "tiny-gpt2", **body)["choices"]]

    alone = [texts(b) for b in bodies]
    with ThreadPoolExecutor(len(bodies) * 2) as pool:
        together = list(pool.map(texts, bodies * 2))
    assert together == alone * 2


def test_chat_response_format_plain_and_streamed(llama_client):
    """Chat on a model with a template (the tiny llama): the same constrained answer plain and streamed."""
    fields = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "Hi"}],
        "temperature": 0,
        "max_tokens": 60,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    }
    body = llama_client.post("/v1/chat/completions", json=fields).get_json()
    text = body["choices"][0]["message"]["content"]
    resp = llama_client.post("/v1/chat/completions", json={**fields, "stream": True})
    streamed = ""
    for chunk in iter_json(resp.get_data()):
        for choice in chunk["choices"]:
            streamed += choice["delta"].get("content") or ""
    assert streamed == text
    if body["choices"][0]["finish_reason"] == "stop":
        import jsonschema

        jsonschema.validate(json.loads(text), PERSON)
    else:
        assert text.startswith("{")


def test_bad_constraints_are_400_and_the_server_keeps_serving(gpt2_client):
    for fields, param in [
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
        ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: ((("}}, "structured_outputs"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": 7}}}},
                }
            },
            "response_format",
        ),
    ]:
        resp = gpt2_client.post("/v1/completions", json={"model": "tiny-gpt2", "prompt": "x", **fields})
        assert resp.status_code == 400, resp.get_data(as_text=True)
        error = resp.get_json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
        streamed = gpt2_client.post(
            "/v1/completions", json={"model": "tiny-gpt2", "prompt": "x", "stream": True, **fields}
        )
        assert streamed.status_code == 400 and streamed.mimetype == "application/json"  # before any stream
    assert complete(gpt2_client, "tiny-gpt2", prompt="x", max_tokens=2)["choices"][0]["finish_reason"] == "length"


def test_gbnf_grammars_are_taken_too(gpt2_client):
    body = complete(
        gpt2_client,
        "tiny-gpt2",
        prompt="Answer:",
        max_tokens=10,
        structured_outputs={"grammar": 'root ::= "yes" | "no"'},
    )
    assert body["choices"][0]["text"] in ("yes", "no")


def test_objects_that_list_properties_take_no_others_unless_the_schema_says():
    from app.engine.sampling.json_schemas import closed_objects

    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"a": {}}},
            "free": {"type": "object", "additionalProperties": True, "properties": {"b": {}}},
        },
        "$defs": {"p": {"properties": {"x": {}}}},
        "items": [{"properties": {}}],
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]  # a map of names, not a schema
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert closed["properties"]["free"]["additionalProperties"] is True
    assert closed["$defs"]["p"]["additionalProperties"] is False and "additionalProperties" not in closed["$defs"]
    assert closed["items"][0]["additionalProperties"] is False


def test_schema_keywords_the_grammar_cannot_enforce_are_400(gpt2_client):
    resp = gpt2_client.post(
        "/v1/completions",
        json={
            "model": "tiny-gpt2",
            "prompt": "x",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
            },
        },
    )
    assert resp.status_code == 400 and resp.get_json()["error"]["param"] == "response_format"
    assert "uniqueItems" in resp.get_json()["error"]["message"]


def test_an_output_completed_on_its_last_allowed_token_is_stop(gpt2_client):
    fields = dict(prompt="Pick:", structured_outputs={"choice": ["red apple", "green pear"]})
    whole = complete(gpt2_client, "tiny-gpt2", max_tokens=20, **fields)
    tokens = whole["usage"]["completion_tokens"]
    exact = complete(gpt2_client, "tiny-gpt2", max_tokens=tokens, **fields)
    assert exact["choices"][0]["text"] == whole["choices"][0]["text"]
    assert exact["choices"][0]["finish_reason"] == "stop"
    cut = complete(gpt2_client, "tiny-gpt2", max_tokens=tokens - 1, **fields)
    assert cut["choices"][0]["finish_reason"] == "length"


def test_processed_logprobs_list_no_ruled_out_tokens(gpt2_client):
    """With the mask in the processed distribution, tokens it rules out (-inf) are not alternatives: the body
    stays valid JSON (no -Infinity) and every listed alternative was allowed."""
    resp = gpt2_client.post(
        "/v1/completions",
        json={
            "model": "tiny-gpt2",
            "prompt": "Pick:",
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": 5,
            "logprobs_mode": "processed_logprobs",
            "structured_outputs": {"choice": ["red", "green"]},
        },
    )
    text = resp.get_data(as_text=True)
    assert resp.status_code == 200 and "Infinity" not in text
    body = json.loads(text)
    for top in body["choices"][0]["logprobs"]["top_logprobs"]:
        assert top and all(value > float("-inf") for value in top.values())


def test_vllm_guided_fields_are_taken_as_structured_outputs(gpt2_client):
    """vLLM's names before 0.12 (guided_json, guided_regex, guided_choice, guided_grammar) still constrain."""
    body = complete(gpt2_client, "tiny-gpt2", prompt="x", max_tokens=20, guided_choice=["yes", "no"])
    assert body["choices"][0]["text"] in ("yes", "no")
    body = complete(gpt2_client, "tiny-gpt2", prompt="x", max_tokens=30, guided_regex="[0-9]{3}")
    assert re.fullmatch("[0-9]{3}", body["choices"][0]["text"])
    both = gpt2_client.post(
        "/v1/completions",
        json={"model": "tiny-gpt2", "prompt": "x", "guided_regex": "a", "structured_outputs": {"regex": "b"}},
    )
    assert both.status_code == 400 and both.get_json()["error"]["param"] == "structured_outputs"
