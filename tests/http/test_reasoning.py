"""Reasoning parsers (SAKER_REASONING_PARSER=think): the reader on its own (whole answers and any split into pieces
say the same), and served: chat's message.reasoning / reasoning_content plain and streamed, and the Responses
API's reasoning item and events. The tiny model is made to think by a regex (it never would by itself)."""

from __future__ import annotations


import pytest

from app.reasoning import ThinkStream, starts_inside
from tooling.sse import iter_json
from conftest import make_settings
from test_tools import TOOL_TEMPLATE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

READS = [
    # (answer text, starts inside, thoughts, content)
    ("<think>\nLet me see.\n</think>\n\nParis.", False, "Let me see.\n", "Paris."),
    ("  <think>a</think>b", False, "a", "b"),
    ("Paris.", False, "", "Paris."),
    ("Paris. <think>x</think>", False, "", "Paris. <think>x</think>"),  # only a leading tag opens thoughts
    ("I weigh it.\n</think>\n\nRome.", True, "I weigh it.\n", "Rome."),  # the prompt opened <think>
    ("<think>never closed", False, "never closed", ""),
    ("<thin", False, "", "<thin"),
    ("<think></think>Hi", False, "", "Hi"),
]


@pytest.mark.parametrize("text, inside, thoughts, content", READS)
def test_reader_whole_and_in_pieces(text, inside, thoughts, content):
    for size in (len(text) or 1, 1, 2, 5):
        reader = ThinkStream(inside)
        got_t, got_c = "", ""
        for at in range(0, len(text), size):
            t, c = reader.feed(text[at : at + size])
            got_t, got_c = got_t + t, got_c + c
        t, c = reader.finish()
        assert (got_t + t, got_c + c) == (thoughts, content), size


def test_prompts_that_open_the_thoughts():
    assert starts_inside("<|im_start|>assistant\n<think>\n")
    assert not starts_inside("<|im_start|>assistant\n")
    assert not starts_inside("<think>x</think>\n<|im_start|>assistant\n")


THOUGHT = r"<think>\nI think [a-z]{2,8}\.\n</think>\n\nHello there\."


@pytest.fixture(scope="module")
def client(gpt2_dir, gpt2_worker):
    from app import create_app

    app = create_app(
        make_settings(
            model=str(gpt2_dir), served_model_name="tiny-gpt2", chat_template=TOOL_TEMPLATE, reasoning_parser="think"
        ),
        worker=gpt2_worker,
    )
    app.config["TESTING"] = True
    return app.test_client()


def test_chat_returns_thoughts_apart_plain_and_streamed(client):
    body = {
        "model": "tiny-gpt2",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 60,
        "temperature": 0,
        "structured_outputs": {"regex": THOUGHT},
    }
    message = client.post("/v1/chat/completions", json=body).get_json()["choices"][0]["message"]
    assert message["content"] == "Hello there."
    assert message["reasoning"].startswith("I think ") and message["reasoning"] == message["reasoning_content"]
    frames = client.post("/v1/chat/completions", json={**body, "stream": True}).get_data()
    thoughts, content = "", ""
    for chunk in iter_json(frames):
        delta = chunk["choices"][0]["delta"]
        assert delta.get("reasoning") == delta.get("reasoning_content")
        thoughts += delta.get("reasoning") or ""
        content += delta.get("content") or ""
    assert (thoughts, content) == (message["reasoning"], message["content"])


def test_without_a_parser_the_answer_is_whole(gpt2_dir, gpt2_worker):
    from app import create_app

    plain = create_app(
        make_settings(model=str(gpt2_dir), served_model_name="tiny-gpt2", chat_template=TOOL_TEMPLATE),
        worker=gpt2_worker,
    ).test_client()
    resp = plain.post(
        "/v1/chat/completions",
        json={
            "model": "tiny-gpt2",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 60,
            "temperature": 0,
            "structured_outputs": {"regex": THOUGHT},
        },
    )
    message = resp.get_json()["choices"][0]["message"]
    assert message["content"].startswith("<think>") and "reasoning" not in message


def test_responses_have_a_reasoning_item_before_the_message(client):
    body = {
        "model": "tiny-gpt2",
        "input": "Hi",
        "max_output_tokens": 60,
        "temperature": 0,
        "structured_outputs": {"regex": THOUGHT},
    }
    response = client.post("/v1/responses", json=body).get_json()
    kinds = [item["type"] for item in response["output"]]
    assert kinds == ["reasoning", "message"]
    thoughts = response["output"][0]["content"][0]["text"]
    assert thoughts.startswith("I think ") and response["output"][1]["content"][0]["text"] == "Hello there."
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    events = list(iter_json(client.post("/v1/responses", json={**body, "stream": True}).get_data()))
    types = [e["type"] for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[2]["item"]["type"] == "reasoning"
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == thoughts
    assert types.index("response.reasoning_text.done") < types.index("response.content_part.added")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed"
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["reasoning", "message"]
