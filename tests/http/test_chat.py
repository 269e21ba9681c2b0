"""Chat completions against apply_chat_template + model.generate(), chat logprobs, templates, and the
tokenizer endpoints against the tokenizer itself."""

from __future__ import annotations


import pytest
import torch

from tooling.sse import iter_json, read_stream
from conftest import make_settings
from references import continuation

MESSAGES = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "Say hello 東京"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": [{"type": "text", "text": "Again, "}, {"type": "text", "text": "please"}]},
]
FLAT = [MESSAGES[0], MESSAGES[1], MESSAGES[2], {"role": "user", "content": "Again, please"}]


def reference_chat(model, tok, messages, max_new):
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=max_new,
        do_sample=False,
        pad_token_id=tok.eos_token_id,
    )[0].tolist()
    return ids, out[len(ids) :], continuation(tok, ids, out)


def test_chat_matches_template_and_generate(llama_client, reference, llama_dir):
    model, tok = reference(llama_dir)
    ids, gen, text = reference_chat(model, tok, FLAT, 10)
    assert ids.count(tok.bos_token_id) == 1, "the template carries BOS; none is added a second time"
    body = llama_client.post(
        "/v1/chat/completions", json={"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 10, "temperature": 0}
    ).get_json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": text, "refusal": None}
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["completion_tokens"] == len(gen)
    assert body["system_fingerprint"].startswith("fp_")
    again = llama_client.post(
        "/v1/chat/completions", json={"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 1, "stream": True}
    )
    chunks = list(iter_json(again.get_data()))
    assert {c["system_fingerprint"] for c in chunks} == {body["system_fingerprint"]}  # stable across answers
    tokenized = llama_client.post("/tokenize", json={"messages": MESSAGES}).get_json()
    assert tokenized["tokens"] == ids and tokenized["count"] == len(ids)


def test_chat_stream_equals_plain(llama_client):
    body = {
        "model": "tiny-llama",
        "messages": MESSAGES,
        "max_tokens": 16,
        "temperature": 0.9,
        "seed": 4,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 2,
        "stream_options": {"include_usage": True},
    }
    plain = llama_client.post("/v1/chat/completions", json={**body, "stream_options": None}).get_json()
    stream = read_stream(llama_client.post("/v1/chat/completions", json={**body, "stream": True}).get_data())
    assert stream.done
    chunks = stream.chunks
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["usage"] == plain["usage"] and chunks[-1]["choices"] == []
    for choice in plain["choices"]:
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == choice["index"]]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert all(m["finish_reason"] is None for m in mine[:-1])
        assert mine[-1]["finish_reason"] == choice["finish_reason"]
        assert "".join(m["delta"].get("content", "") for m in mine) == choice["message"]["content"]
        streamed_lps = [e for m in mine if m["logprobs"] for e in m["logprobs"]["content"]]
        assert streamed_lps == choice["logprobs"]["content"]


def test_chat_logprobs_shape_and_values(llama_client, reference, llama_dir):
    model, tok = reference(llama_dir)
    ids, gen, _ = reference_chat(model, tok, FLAT, 6)
    body = llama_client.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "max_completion_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3},
    ).get_json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == len(gen)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids + gen])).logits[0].float(), -1)
    for i, entry in enumerate(content):
        row = lp[len(ids) + i - 1]
        assert entry["logprob"] == pytest.approx(row[gen[i]].item(), abs=1e-4)
        assert entry["bytes"] == list(entry["token"].encode("utf-8"))
        assert len(entry["top_logprobs"]) == 3
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(
            torch.topk(row, 3).values.tolist(), abs=1e-4
        )
        for top in entry["top_logprobs"]:
            if not top["token"].startswith("bytes:"):
                assert top["bytes"] == list(top["token"].encode("utf-8"))
    plain = llama_client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}).get_json()
    assert plain["choices"][0]["logprobs"] is None


def test_no_template_is_a_clear_400_and_setting_supplies_one(gpt2_client, gpt2_dir, gpt2_worker, tmp_path):
    from app import create_app

    response = gpt2_client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400
    error = response.get_json()["error"]
    assert error["param"] == "messages" and "SAKER_CHAT_TEMPLATE" in error["message"]
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] ")
    for value in (str(template), template.read_text()):
        settings = make_settings(model=str(gpt2_dir), served_model_name="tiny-gpt2", chat_template=value)
        client = create_app(settings, worker=gpt2_worker).test_client()
        tok = gpt2_worker.runner.tokenizer
        expected = tok("[user] hi\n[assistant] ", add_special_tokens=False)["input_ids"]
        tokenized = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).get_json()
        assert tokenized["tokens"] == expected
        body = client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        ).get_json()
        assert body["usage"]["prompt_tokens"] == len(expected)
        assert client.get("/tokenizer_info").get_json()["chat_template"] == template.read_text()


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}, "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 100_000}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_chat_bad_inputs(llama_client, body, param):
    response = llama_client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.get_json()
    error = response.get_json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    ok = llama_client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    )
    assert ok.status_code == 200


def test_tokenize_detokenize_and_info_match_the_tokenizer(tiny, reference):
    client, path, _ = tiny
    _, tok = reference(path)
    text = "Hello 東京 🙂"
    body = client.post("/tokenize", json={"prompt": text, "return_token_strs": True}).get_json()
    assert body["tokens"] == tok(text)["input_ids"]
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    plain = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).get_json()
    assert plain["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    assert client.post("/detokenize", json={"tokens": body["tokens"]}).get_json() == {
        "prompt": tok.decode(body["tokens"])
    }
    info = client.get("/tokenizer_info").get_json()
    assert info["eos_token_id"] == tok.eos_token_id and info["eos_token"] == tok.eos_token
    assert info["bos_token"] == tok.bos_token and info["model_max_length"] == 256
    assert info["add_bos_token"] == (tok("a")["input_ids"][0] == tok.bos_token_id)
    for bad, param in [({"tokens": [10**6]}, "tokens"), ({"tokens": "x"}, "tokens")]:
        response = client.post("/detokenize", json=bad)
        assert response.status_code == 400 and response.get_json()["error"]["param"] == param
    response = client.post("/tokenize", json={"prompt": "x", "messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 400
    response = client.post("/tokenize", json={"prompt": "x", "model": "nope"})
    assert response.status_code == 404


def test_tokenize_messages_without_template_is_400_with_special_tokens_too(gpt2_client):
    for add in (None, True, False):
        body = {"messages": [{"role": "user", "content": "hi"}]}
        if add is not None:
            body["add_special_tokens"] = add
        response = gpt2_client.post("/tokenize", json=body)
        assert response.status_code == 400, (add, response.get_json())
        assert response.get_json()["error"]["param"] == "messages"
