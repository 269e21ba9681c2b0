"""vLLM's chat template fields, on chat and /tokenize alike: continue_final_message (against the tokenizer's
own apply_chat_template), chat_template_kwargs and documents reaching the template, chat echo, token_strs null
unless asked, and their 400s."""

from __future__ import annotations


import pytest

from tooling.sse import iter_json
from conftest import make_settings

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEMPLATE = (
    "{% if documents %}[docs:{% for d in documents %}{{ d.title }};{% endfor %}]{% endif %}"
    "{% if flavor %}[flavor:{{ flavor }}]{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% if not (loop.last and continue_final_message) %}"
    "<|end|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PARTIAL = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "A fruit is the"}]


@pytest.fixture(scope="module")
def client(gpt2_dir, gpt2_worker):
    from app import create_app

    return create_app(
        make_settings(model=str(gpt2_dir), served_model_name="tiny-gpt2", chat_template=TEMPLATE), worker=gpt2_worker
    ).test_client()


def tokenize(client, **body):
    resp = client.post("/tokenize", json={"model": "tiny-gpt2", **body})
    assert resp.status_code == 200, resp.get_data(as_text=True)
    return resp.get_json()


def test_continue_final_message_matches_the_tokenizer(client, gpt2_dir, reference):
    _, tok = reference(gpt2_dir)
    want = tok.apply_chat_template(
        PARTIAL,
        chat_template=TEMPLATE,
        continue_final_message=True,
        tokenize=True,
        add_generation_prompt=False,
        return_dict=False,
    )
    got = tokenize(client, messages=PARTIAL, continue_final_message=True)
    assert got["tokens"] == list(want) and got["token_strs"] is None
    assert tok.decode(got["tokens"]).endswith("A fruit is the")
    chat = client.post(
        "/v1/chat/completions",
        json={
            "model": "tiny-gpt2",
            "messages": PARTIAL,
            "max_tokens": 3,
            "temperature": 0,
            "continue_final_message": True,
        },
    ).get_json()
    assert chat["usage"]["prompt_tokens"] == len(want)


def test_template_kwargs_and_documents_reach_the_template(client, gpt2_dir, reference):
    _, tok = reference(gpt2_dir)
    got = tokenize(
        client,
        messages=PARTIAL[:1],
        chat_template_kwargs={"flavor": "sour"},
        documents=[{"title": "A", "text": "x"}, {"title": "B", "text": "y"}],
        return_token_strs=True,
    )
    text = tok.decode(got["tokens"])
    assert text.startswith("[docs:A;B;][flavor:sour]") and len(got["token_strs"]) == got["count"]
    chat = client.post(
        "/v1/chat/completions",
        json={
            "model": "tiny-gpt2",
            "messages": PARTIAL[:1],
            "max_tokens": 1,
            "chat_template_kwargs": {"flavor": "sour"},
        },
    ).get_json()
    assert chat["usage"]["prompt_tokens"] == len(
        tok(
            tok.apply_chat_template(
                PARTIAL[:1], chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True, flavor="sour"
            )
        )["input_ids"]
    )


def test_chat_echo_starts_the_answer_with_the_last_assistant_message(client):
    body = {
        "model": "tiny-gpt2",
        "messages": PARTIAL,
        "max_tokens": 4,
        "temperature": 0,
        "continue_final_message": True,
    }
    plain = client.post("/v1/chat/completions", json=body).get_json()["choices"][0]["message"]["content"]
    echoed = client.post("/v1/chat/completions", json={**body, "echo": True}).get_json()
    assert echoed["choices"][0]["message"]["content"] == "A fruit is the" + plain
    frames = client.post("/v1/chat/completions", json={**body, "echo": True, "stream": True}).get_data()
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in iter_json(frames) if c["choices"])
    assert streamed == "A fruit is the" + plain
    user_last = client.post(
        "/v1/chat/completions",
        json={"model": "tiny-gpt2", "messages": PARTIAL[:1], "max_tokens": 2, "temperature": 0, "echo": True},
    ).get_json()
    assert not user_last["choices"][0]["message"]["content"].startswith("Name a fruit")


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        ({"continue_final_message": True, "messages": PARTIAL[:1]}, "continue_final_message"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": "flavor"}, "chat_template_kwargs"),
        ({"documents": "x"}, "documents"),
    ],
)
def test_bad_template_fields_are_400(client, fields, param):
    for url in ("/v1/chat/completions", "/tokenize"):
        resp = client.post(url, json={"model": "tiny-gpt2", "messages": PARTIAL, **fields})
        assert resp.status_code == 400 and resp.get_json()["error"]["param"] == param, resp.get_data(as_text=True)
