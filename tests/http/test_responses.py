"""The Responses API (POST /v1/responses, GET/DELETE /v1/responses/{id}).

- Every response object and stream event of a range of requests (text, instructions, tool calls forced and named,
  json_schema, logprobs, ignored tool types, a cut answer, stored responses) validated against OpenAI's own
  ``Response`` / ``ResponseStreamEvent`` schemas (tests/data/openai_responses_schema.json, vendored from
  github.com/openai/openai-openapi: see tests/data/extract_openai_schema.py).
- Greedy output for a string ``input`` is chat's for that user message, token for token (the tiny llama).
- Stream events: sequence numbers, created/in_progress first, completed/incomplete last, item events in order and
  adding up to the final response; a cut answer is ``response.incomplete``.
- Conversations: ``previous_response_id``, ``function_call_output`` round trips, the store (GET/DELETE/404,
  ``store: false``), and bad input as 4xx in OpenAI's error shape, the server serving on.
- Under a real gunicorn (slow): the official ``openai`` client (create, stream, parse into a Pydantic model on the
  embedded SmolLM2, function tools, previous_response_id with the prefix cache, GET/DELETE), a dropped stream
  stopping its generation, the OpenAI Agents SDK running a function tool, and the Codex CLI (``codex exec``) with
  saker as a custom ``wire_api = "responses"`` provider.

The tiny GPT-2 gets the Hermes-style TOOL_TEMPLATE of tests/http/test_tools.py (its tool calls are forced by the
grammar; its words are random and rarely end before their limit). The Agents SDK's whole loop and Codex (a ~6k-token
prompt) run on an "echo llama": tiny, 16k positions, SmolLM2's tokenizer and the shipped Hermes tool template,
answering a fixed sentence (build_echo_llama)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import jsonschema
import pytest
import requests

from tooling.sse import iter_events
from conftest import make_settings
from servers import Gunicorn, openai_client, running
from test_tools import TOOL_TEMPLATE
from weather_agent import weather_agent

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_FILE = Path(__file__).resolve().parents[1] / "data" / "openai_responses_schema.json"
HERMES_TEMPLATE = ROOT / "deploy" / "chat-templates" / "smollm2-hermes-tools.jinja"
MODEL = "tiny-gpt2"

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TIME = {
    "type": "function",
    "name": "get_time",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
TOOLS = [WEATHER, TIME]
ARGUMENT_SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
QUESTION = "What is the weather in Paris?"
GET_TIME = {"type": "function", "name": "get_time"}  # its calls are short: the tiny GPT-2 has 256 positions
CITY_FORMAT = {
    "format": {
        "type": "json_schema",
        "name": "city",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
}


# -- OpenAI's schema ------------------------------------------------------------------------------------------------
def _load_schema() -> dict:
    return json.loads(SCHEMA_FILE.read_text())


SCHEMA = _load_schema()
_VALIDATORS: dict[str, jsonschema.Draft202012Validator] = {}


def _validator(name: str) -> jsonschema.Draft202012Validator:
    if name not in _VALIDATORS:
        _VALIDATORS[name] = jsonschema.Draft202012Validator({"$defs": SCHEMA["$defs"], "$ref": f"#/$defs/{name}"})
    return _VALIDATORS[name]


def _event_definitions() -> dict[str, str]:
    """Event type -> the name of its definition (the branches of ResponseStreamEvent)."""
    out = {}
    for branch in SCHEMA["$defs"]["ResponseStreamEvent"]["anyOf"]:
        name = branch["$ref"].rsplit("/", 1)[1]
        for kind in SCHEMA["$defs"][name]["properties"]["type"]["enum"]:
            out[kind] = name
    return out


EVENT_DEFINITIONS = _event_definitions()


def _describe(error: jsonschema.ValidationError) -> list[str]:
    """The useful lines of an error: for a oneOf/anyOf, the errors of the branches whose ``type`` matched."""
    if error.context:
        branches: dict = {}
        for e in error.context:
            branches.setdefault(e.relative_schema_path[0], []).append(e)
        # a branch for another kind of object (its "type" differs) or for null says nothing useful
        relevant = [
            e
            for errors in branches.values()
            if not any(
                (e.validator in ("enum", "const") and list(e.relative_path) == ["type"])
                or (e.validator == "type" and e.validator_value == "null")
                for e in errors
            )
            for e in errors
        ]
        if relevant:
            return [line for e in relevant for line in _describe(e)]
    where = "/".join(str(p) for p in error.absolute_path) or "(top)"
    return [f"{where}: {error.message[:300]}"]


def schema_problems(instance: dict, name: str) -> list[str]:
    """What makes ``instance`` invalid against OpenAI's definition ``name``; a stream event is checked against the
    definition of its own type (clear errors rather than 'not valid under any of the given schemas')."""
    if name == "ResponseStreamEvent":
        kind = instance.get("type")
        if kind not in EVENT_DEFINITIONS:
            return [f"event type {kind!r} is not a ResponseStreamEvent"]
        name = EVENT_DEFINITIONS[kind]
    return sorted({line for error in _validator(name).iter_errors(instance) for line in _describe(error)})


def assert_valid(instance: dict, name: str) -> None:
    problems = schema_problems(instance, name)
    assert not problems, f"not a valid OpenAI {name}:\n  " + "\n  ".join(problems) + "\n" + json.dumps(instance)[:3000]


def test_vendored_schema_is_self_contained_and_says_where_it_came_from():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert "openai/openai-openapi" in SCHEMA["description"] and re.search(r"\b[0-9a-f]{40}\b", SCHEMA["description"])
    text = SCHEMA_FILE.read_text()
    assert "#/components/" not in text and "$recursiveRef" not in text
    refs = set(re.findall(r'"\$ref": "#/\$defs/([^"]+)"', text))
    assert refs <= set(SCHEMA["$defs"]), refs - set(SCHEMA["$defs"])
    for kind in (
        "response.created",
        "response.in_progress",
        "response.completed",
        "response.incomplete",
        "response.failed",
        "response.output_item.added",
        "response.output_item.done",
        "response.content_part.added",
        "response.content_part.done",
        "response.output_text.delta",
        "response.output_text.done",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "error",
    ):
        assert kind in EVENT_DEFINITIONS
    # the checker itself: a made-up field type and a missing field are caught, with their place
    assert any("output" in p for p in schema_problems({"id": "resp_1", "object": "response", "output": 3}, "Response"))
    assert schema_problems({"type": "response.output_text.delta", "sequence_number": 0}, "ResponseStreamEvent")


# -- in-process helpers ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tool_app(gpt2_dir, gpt2_worker):
    from app import create_app

    app = create_app(
        make_settings(
            model=str(gpt2_dir),
            served_model_name=MODEL,
            chat_template=TOOL_TEMPLATE,
            json_whitespace="",  # a random tiny model writes whitespace wherever a grammar allows it
        ),
        worker=gpt2_worker,
    )
    app.config["TESTING"] = True
    return app


@pytest.fixture()
def tool_client(tool_app):
    return tool_app.test_client()


def create(client, expect: int = 200, **body):
    body = {"model": MODEL, "temperature": 0, **body}
    resp = client.post("/v1/responses", json=body)
    assert resp.status_code == expect, resp.get_data(as_text=True)
    return resp.get_json()


def sse_events(text: str) -> list[dict]:
    """Server-sent Responses events: each frame is ``event: <type>`` and ``data: <the event>``."""
    assert all(len(frame.split("\n")) == 2 for frame in text.split("\n\n")[:-1]), text
    events = []
    for frame in iter_events(text):
        event = frame.json()
        assert frame.event == event["type"], frame
        events.append(event)
    return events


def stream(client, **body) -> list[dict]:
    body = {"model": MODEL, "temperature": 0, **body, "stream": True}
    resp = client.post("/v1/responses", json=body)
    assert resp.status_code == 200, resp.get_data(as_text=True)
    assert resp.mimetype == "text/event-stream"
    return sse_events(resp.get_data(as_text=True))


def output_text(response: dict) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )


def calls_of(response: dict) -> list[dict]:
    return [item for item in response["output"] if item["type"] == "function_call"]


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def argument_deltas(events: list[dict]) -> dict[int, list[str]]:
    """The ``response.function_call_arguments.delta`` pieces of a stream, by output index."""
    out: dict[int, list[str]] = {}
    for event in events:
        if event["type"] == "response.function_call_arguments.delta":
            out.setdefault(event["output_index"], []).append(event["delta"])
    return out


def check_events(events: list[dict]) -> dict:
    """The order and consistency of a stream's events; returns the final response. Sequence numbers count from
    0 by 1; created and in_progress come first, completed or incomplete last; each output item is added, filled
    (text deltas in a content part, or argument deltas) and done, in output order, and the deltas add up to the
    done events and to the final response."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    terminal = {"response.completed", "response.incomplete", "response.failed", "error"}
    assert not terminal & set(kinds[:-1]), kinds
    final = events[-1]["response"]
    first = events[0]["response"]
    assert first["status"] == events[1]["response"]["status"] == "in_progress"
    assert first["id"] == events[1]["response"]["id"] == final["id"] and first["output"] == []
    assert final["status"] == ("completed" if kinds[-1] == "response.completed" else "incomplete")
    items: list[dict] = []  # as added
    open_item = None  # the item between its added and done events
    text = arguments = None
    part_open = False
    for event in events[2:-1]:
        kind = event["type"]
        if kind == "response.output_item.added":
            assert open_item is None, "an item is added while another is open"
            assert event["output_index"] == len(items)
            open_item = event["item"]
            assert open_item["status"] == "in_progress" and open_item["id"]
            items.append(open_item)
            text, arguments = "", ""
            if open_item["type"] == "message":
                assert open_item["content"] == [] and open_item["role"] == "assistant"
            else:
                assert open_item["type"] == "function_call" and open_item["arguments"] == ""
            continue
        assert open_item is not None, f"{kind} outside an item"
        assert event["output_index"] == len(items) - 1
        if kind != "response.output_item.done":
            assert event["item_id"] == open_item["id"], event
        if kind == "response.content_part.added":
            assert open_item["type"] == "message" and not part_open and event["content_index"] == 0
            assert event["part"]["type"] == "output_text" and event["part"]["text"] == ""
            part_open = True
        elif kind == "response.output_text.delta":
            assert part_open and event["content_index"] == 0 and event["delta"]
            text += event["delta"]
        elif kind == "response.output_text.done":
            assert part_open and event["text"] == text
        elif kind == "response.content_part.done":
            assert part_open and event["part"]["text"] == text
            part_open = False
        elif kind == "response.function_call_arguments.delta":
            assert open_item["type"] == "function_call"
            arguments += event["delta"]
        elif kind == "response.function_call_arguments.done":
            assert open_item["type"] == "function_call" and event["arguments"] == arguments
            assert event["name"] == open_item["name"]
        elif kind == "response.output_item.done":
            assert not part_open, "output_item.done before content_part.done"
            done = event["item"]
            assert done["id"] == open_item["id"] and done["type"] == open_item["type"]
            # an answer cut by max_output_tokens leaves its message (or thoughts) incomplete, as OpenAI's do, and
            # a call it cut inside its arguments (no whole JSON)
            cut = final["status"] == "incomplete" and (
                done["type"] in ("message", "reasoning")
                or (done["type"] == "function_call" and not is_json(done["arguments"]))
            )
            assert done["status"] == ("incomplete" if cut else "completed")
            assert done == final["output"][event["output_index"]]
            if done["type"] == "message":
                assert [p["text"] for p in done["content"]] == [text]
            else:
                assert done["arguments"] == arguments
            open_item = None
        else:
            raise AssertionError(f"unexpected event {kind}")
    assert open_item is None, "an item was never done"
    assert len(items) == len(final["output"])
    return final


# -- every response and event against OpenAI's schema -------------------------------------------------------------
SCHEMA_CASES = [
    ("string-input", {"input": "Hello there", "max_output_tokens": 8}),
    (
        "messages-instructions-metadata",
        {
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
                {"role": "user", "content": "Count to three."},
            ],
            "instructions": "Be brief.",
            "metadata": {"purpose": "test"},
            "max_output_tokens": 8,
            "top_p": 0.9,
        },
    ),
    ("cut-at-max-output-tokens", {"input": "Once upon a time", "max_output_tokens": 3, "ignore_eos": True}),
    (
        "tool-required",
        {
            "input": QUESTION,
            "tools": TOOLS,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_output_tokens": 120,
        },
    ),
    (
        "tool-named",
        {
            "input": QUESTION,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "name": "get_time"},
            "max_output_tokens": 120,
        },
    ),
    ("json-schema", {"input": "A city, as JSON", "max_output_tokens": 80, "text": CITY_FORMAT}),
    ("json-object", {"input": "Some JSON", "max_output_tokens": 30, "text": {"format": {"type": "json_object"}}}),
    (
        "logprobs",
        {"input": "Hello", "max_output_tokens": 5, "include": ["message.output_text.logprobs"], "top_logprobs": 2},
    ),
    (
        "ignored-tool-types",
        {
            "input": "Hello",
            "max_output_tokens": 5,
            "tools": [{"type": "web_search"}, {"type": "code_interpreter", "container": {"type": "auto"}}, WEATHER],
        },
    ),
    (
        "function-tool-without-strict",
        {
            "input": QUESTION,
            "max_output_tokens": 5,
            "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER["parameters"]}],
        },
    ),
]


@pytest.mark.parametrize("body", [c[1] for c in SCHEMA_CASES], ids=[c[0] for c in SCHEMA_CASES])
def test_response_objects_match_openai_schema(tool_client, body):
    response = create(tool_client, **body)
    assert_valid(response, "Response")
    stored = tool_client.get(f"/v1/responses/{response['id']}")
    assert stored.status_code == 200 and stored.get_json() == response
    assert_valid(stored.get_json(), "Response")


@pytest.mark.parametrize("body", [c[1] for c in SCHEMA_CASES], ids=[c[0] for c in SCHEMA_CASES])
def test_stream_events_match_openai_schema(tool_client, body):
    events = stream(tool_client, **body)
    problems = [
        f"event {e['sequence_number']} ({e['type']}): {p}"
        for e in events
        for p in schema_problems(e, "ResponseStreamEvent")
    ]
    assert not problems, "events not valid against OpenAI's ResponseStreamEvent:\n  " + "\n  ".join(problems)


def test_continued_and_deleted_objects_match_openai_schema(tool_client):
    first = create(
        tool_client, input=QUESTION, tools=TOOLS, tool_choice=GET_TIME, parallel_tool_calls=False, max_output_tokens=80
    )
    [call] = calls_of(first)
    second = create(
        tool_client,
        previous_response_id=first["id"],
        max_output_tokens=6,
        tools=TOOLS,
        input=[{"type": "function_call_output", "call_id": call["call_id"], "output": "18 C, sunny"}],
    )
    assert_valid(second, "Response")
    assert second["previous_response_id"] == first["id"]
    deleted = tool_client.delete(f"/v1/responses/{second['id']}").get_json()
    assert deleted == {"id": second["id"], "object": "response.deleted", "deleted": True}


# -- greedy output is chat's --------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", ["Hello there", "The capital of France is", "Café 🙂 東京", ""])
def test_string_input_equals_chat_token_for_token(llama_client, prompt):
    chat = llama_client.post(
        "/v1/chat/completions",
        json={
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
            "max_tokens": 24,
        },
    ).get_json()
    response = create(llama_client, model="tiny-llama", input=prompt, max_output_tokens=24)
    assert output_text(response) == chat["choices"][0]["message"]["content"]
    assert response["usage"]["output_tokens"] == chat["usage"]["completion_tokens"]
    assert response["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert response["usage"]["total_tokens"] == chat["usage"]["total_tokens"]
    assert response["status"] == ("incomplete" if chat["choices"][0]["finish_reason"] == "length" else "completed")
    final = check_events(stream(llama_client, model="tiny-llama", input=prompt, max_output_tokens=24))
    assert output_text(final) == output_text(response)
    assert final["usage"]["output_tokens"] == response["usage"]["output_tokens"]


def test_instructions_and_message_items_equal_chat_messages(llama_client):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Count to three."},
    ]
    chat = llama_client.post(
        "/v1/chat/completions", json={"model": "tiny-llama", "messages": messages, "temperature": 0, "max_tokens": 16}
    ).get_json()
    response = create(
        llama_client,
        model="tiny-llama",
        instructions="Be brief.",
        max_output_tokens=16,
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
            {"type": "message", "role": "user", "content": "Count to three."},
        ],
    )
    assert output_text(response) == chat["choices"][0]["message"]["content"]
    assert response["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert response["instructions"] == "Be brief."


def test_output_logprobs_are_chats(llama_client):
    chat = llama_client.post(
        "/v1/chat/completions",
        json={
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "Hello"}],
            "temperature": 0,
            "max_tokens": 6,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ).get_json()
    response = create(
        llama_client,
        model="tiny-llama",
        input="Hello",
        max_output_tokens=6,
        top_logprobs=2,
        include=["message.output_text.logprobs"],
    )
    [message] = response["output"]
    got, want = message["content"][0]["logprobs"], chat["choices"][0]["logprobs"]["content"]

    def rounded(entries):  # the same tokens; the numbers agree to float32 noise (batch shapes differ)
        return [
            {
                **e,
                "logprob": round(e["logprob"], 3),
                "top_logprobs": [{**t, "logprob": round(t["logprob"], 3)} for t in e["top_logprobs"]],
            }
            for e in entries
        ]

    assert len(got) == 6 and rounded(got) == rounded(want)


# -- stream events --------------------------------------------------------------------------------------------------
def test_text_stream_events_in_order(tool_client):
    plain = create(tool_client, input="Hello there", max_output_tokens=12)
    events = stream(tool_client, input="Hello there", max_output_tokens=12)
    final = check_events(events)
    kinds = [e["type"] for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and len(kinds[4:-4]) > 1
    assert output_text(final) == output_text(plain)
    for key in ("input_tokens", "output_tokens", "total_tokens"):  # (cached_tokens: the prefix cache's)
        assert final["usage"][key] == plain["usage"][key]
    stored = tool_client.get(f"/v1/responses/{final['id']}").get_json()
    assert stored == final


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}], ids=["required", "named"])
def test_tool_call_stream_events_in_order(tool_client, choice):
    body = dict(input=QUESTION, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, max_output_tokens=120)
    plain = create(tool_client, **body)
    events = stream(tool_client, **body)
    final = check_events(events)
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * (len(kinds) - 6),
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    [call] = calls_of(final)
    [plain_call] = calls_of(plain)
    assert (call["name"], call["arguments"]) == (plain_call["name"], plain_call["arguments"])
    # the arguments come in pieces as they are written, and the pieces join to the plain answer's arguments
    added = events[2]["item"]
    assert (added["type"], added["name"], added["arguments"]) == ("function_call", plain_call["name"], "")
    assert added["call_id"] == call["call_id"]
    [pieces] = argument_deltas(events).values()
    assert len(pieces) > 1 and "".join(pieces) == plain_call["arguments"]
    if isinstance(choice, dict):
        assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), ARGUMENT_SCHEMAS[call["name"]])
    assert call["call_id"] and call["id"] != call["call_id"] and final["status"] == "completed"


def test_a_named_call_with_a_text_format_is_the_call(tool_client):
    """instructor's RESPONSES_TOOLS mode: a named tool_choice with a json_schema text.format. The answer is the
    call, its arguments valid against the function's schema (the format, an array here, is for a final message)."""
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": {"type": "array"}}}
    body = dict(input=QUESTION, tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"}, text=fmt)
    answer = create(tool_client, parallel_tool_calls=False, max_output_tokens=120, **body)
    [call] = calls_of(answer)
    assert call["name"] == "get_weather" and answer["status"] == "completed"
    assert [item["type"] for item in answer["output"]] == ["function_call"]
    jsonschema.validate(json.loads(call["arguments"]), ARGUMENT_SCHEMAS["get_weather"])


def test_parallel_calls_stream_as_items_of_their_own(tool_client):
    """Several calls in one (seeded) answer: each is a function_call item of its own (added, its argument deltas,
    done, before the next is added), equal to the plain answer's; a call cut by max_output_tokens is incomplete."""
    body = dict(input=QUESTION, tools=TOOLS, tool_choice="required", temperature=1.0, seed=7, max_output_tokens=150)
    plain = create(tool_client, **body)
    events = stream(tool_client, **body)
    final = check_events(events)
    want = [(c["name"], c["arguments"], c["status"]) for c in calls_of(plain)]
    assert len(want) > 1, "the seeded tiny model writes several calls"
    assert [(c["name"], c["arguments"], c["status"]) for c in calls_of(final)] == want
    pieces = argument_deltas(events)
    assert sorted(pieces) == list(range(len(want)))
    for index, (_, arguments, _) in enumerate(want):
        assert len(pieces[index]) > 1 and "".join(pieces[index]) == arguments
    for call in calls_of(final):
        cut = final["status"] == "incomplete" and not is_json(call["arguments"])
        assert call["status"] == ("incomplete" if cut else "completed")
        if not cut:
            jsonschema.validate(json.loads(call["arguments"]), ARGUMENT_SCHEMAS[call["name"]])
    stored = tool_client.get(f"/v1/responses/{final['id']}").get_json()
    assert stored == final


def test_a_call_cut_by_max_output_tokens_is_an_incomplete_item(tool_client):
    """max_output_tokens inside a call's arguments: the function_call item is incomplete, with the arguments written
    so far (a prefix of the whole answer's), plain and streamed alike. (The cut is found from chat's tokens of the
    same prompt: the template renders only the tools' names.)"""
    from test_tools import tokens_into_the_arguments

    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
    cut = tokens_into_the_arguments(
        tool_client, tools=chat_tools, tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    body = dict(input=QUESTION, tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"})
    [whole] = calls_of(create(tool_client, **body))
    plain = create(tool_client, max_output_tokens=cut, **body)
    final = check_events(stream(tool_client, max_output_tokens=cut, **body))
    for response in (plain, final):
        assert response["status"] == "incomplete"
        [call] = calls_of(response)
        assert call["status"] == "incomplete" and call["name"] == "get_weather"
        assert whole["arguments"].startswith(call["arguments"]) and not is_json(call["arguments"])
    assert calls_of(plain)[0]["arguments"] == calls_of(final)[0]["arguments"]


@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
def test_max_output_tokens_gives_incomplete(tool_client, streamed):
    body = dict(input="Once upon a time", max_output_tokens=4, ignore_eos=True)
    if streamed:
        events = stream(tool_client, **body)
        assert events[-1]["type"] == "response.incomplete"
        response = check_events(events)
    else:
        response = create(tool_client, **body)
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["usage"]["output_tokens"] == 4 and response["max_output_tokens"] == 4


def test_an_empty_answer_is_still_a_message(tool_client):
    """An answer that ends at once (a stop string at its start) is a message with empty text, plain and streamed."""
    stop = [output_text(create(tool_client, input="Hello", max_output_tokens=4))[:1]]
    plain = create(tool_client, input="Hello", max_output_tokens=8, stop=stop)
    assert [item["type"] for item in plain["output"]] == ["message"] and output_text(plain) == ""
    assert plain["status"] == "completed" and plain["usage"]["output_tokens"] >= 1
    final = check_events(stream(tool_client, input="Hello", max_output_tokens=8, stop=stop))
    assert output_text(final) == "" and final["status"] == "completed"


# -- conversations and the store ------------------------------------------------------------------------------------
def test_previous_response_id_continues_the_conversation(tool_client):
    first = create(tool_client, input="Hello there", max_output_tokens=6, instructions="Be brief.")
    second = create(tool_client, input="And then?", max_output_tokens=6, previous_response_id=first["id"])
    # the same conversation written out in full, statelessly (instructions are not carried over: OpenAI's rule)
    said = first["output"][0]
    full = create(
        tool_client,
        store=False,
        max_output_tokens=6,
        input=[{"role": "user", "content": "Hello there"}, said, {"role": "user", "content": "And then?"}],
    )
    assert output_text(second) == output_text(full)
    assert second["usage"]["input_tokens"] == full["usage"]["input_tokens"]
    assert second["usage"]["input_tokens"] > first["usage"]["output_tokens"] + 5
    assert second["previous_response_id"] == first["id"] and second["instructions"] is None


@pytest.mark.parametrize("stateless", [False, True], ids=["previous_response_id", "full-input"])
def test_function_call_output_round_trip(tool_client, stateless):
    first = create(
        tool_client, input=QUESTION, tools=TOOLS, tool_choice=GET_TIME, parallel_tool_calls=False, max_output_tokens=80
    )
    assert first["status"] == "completed"
    [call] = calls_of(first)
    answer = {"type": "function_call_output", "call_id": call["call_id"], "output": "18 degrees, sunny"}
    if stateless:
        body = dict(input=[{"role": "user", "content": QUESTION}, call, answer], store=False)
    else:
        body = dict(input=[answer], previous_response_id=first["id"])
    second = create(tool_client, tools=TOOLS, max_output_tokens=8, **body)
    assert [item["type"] for item in second["output"]] == ["message"]
    # the call and its answer are in the prompt
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    if stateless:
        assert tool_client.get(f"/v1/responses/{second['id']}").status_code == 404


def test_get_and_delete(tool_client):
    response = create(tool_client, input="Hello", max_output_tokens=3)
    got = tool_client.get(f"/v1/responses/{response['id']}")
    assert got.status_code == 200 and got.get_json() == response
    deleted = tool_client.delete(f"/v1/responses/{response['id']}")
    assert deleted.status_code == 200
    assert deleted.get_json() == {"id": response["id"], "object": "response.deleted", "deleted": True}
    for resp in (
        tool_client.get(f"/v1/responses/{response['id']}"),
        tool_client.delete(f"/v1/responses/{response['id']}"),
    ):
        assert resp.status_code == 404
        assert resp.get_json()["error"]["type"] == "invalid_request_error"
    follow = tool_client.post(
        "/v1/responses", json={"model": MODEL, "input": "Hi", "previous_response_id": response["id"]}
    )
    assert follow.status_code == 404 and follow.get_json()["error"]["param"] == "previous_response_id"


def test_store_false_keeps_nothing(tool_client):
    response = create(tool_client, input="Hello", max_output_tokens=3, store=False)
    assert response["store"] is False
    assert tool_client.get(f"/v1/responses/{response['id']}").status_code == 404


def test_ignored_tool_types_are_named_in_a_header(tool_client):
    resp = tool_client.post(
        "/v1/responses",
        json={
            "model": MODEL,
            "input": "Hello",
            "max_output_tokens": 3,
            "temperature": 0,
            "tools": [
                {"type": "web_search"},
                {"type": "file_search", "vector_store_ids": ["vs_1"]},
                WEATHER,
                {"type": "web_search"},
            ],
        },
    )
    assert resp.status_code == 200, resp.get_data(as_text=True)
    assert resp.headers["X-Saker-Ignored-Tools"] == "web_search, file_search"
    plain = tool_client.post(
        "/v1/responses", json={"model": MODEL, "input": "Hello", "max_output_tokens": 3, "tools": [WEATHER]}
    )
    assert "X-Saker-Ignored-Tools" not in plain.headers


# -- bad input ------------------------------------------------------------------------------------------------------
BAD = [
    ("unknown-item-type", {"input": [{"type": "telepathy", "content": "hi"}]}, 400, "input"),
    ("input-a-number", {"input": 42}, 400, "input"),
    ("input-missing", {}, 400, "input"),
    ("input-an-empty-list", {"input": []}, 400, "input"),
    (
        "function-call-output-without-its-call",
        {"input": [{"type": "function_call_output", "call_id": "call_nowhere", "output": "18 degrees"}]},
        400,
        "input",
    ),
    (
        "unknown-previous-response-id",
        {"input": "Hi", "previous_response_id": "resp_doesnotexist"},
        404,
        "previous_response_id",
    ),
    ("unknown-text-format", {"input": "Hi", "text": {"format": {"type": "yaml"}}}, 400, "text"),
    (
        "named-tool-not-in-tools",
        {"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}},
        400,
        "tool_choice",
    ),
    ("required-without-tools", {"input": "Hi", "tool_choice": "required"}, 400, "tool_choice"),
    (
        "input-image",
        {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is this?"},
                        {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="},
                    ],
                }
            ]
        },
        400,
        "input",
    ),
    (
        "input-file",
        {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
        400,
        "input",
    ),
    ("unknown-role", {"input": [{"role": "wizard", "content": "hi"}]}, 400, "input"),
    ("max-output-tokens-zero", {"input": "Hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ("temperature-a-string", {"input": "Hi", "temperature": "hot"}, 400, "temperature"),
    ("unknown-model", {"input": "Hi", "model": "gpt-17"}, 404, "model"),
]


@pytest.mark.parametrize("name, body, status, param", BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
def test_bad_input_is_4xx_with_param_and_the_server_keeps_serving(tool_client, name, body, status, param, streamed):
    resp = tool_client.post("/v1/responses", json={"model": MODEL, **body, **({"stream": True} if streamed else {})})
    assert resp.status_code == status, resp.get_data(as_text=True)
    assert resp.mimetype == "application/json"
    error = resp.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    assert create(tool_client, input="Hi", max_output_tokens=1)["status"] == "incomplete"


# -- under a real gunicorn, with the official client -------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_server(gpt2_dir):
    env = {
        "SAKER_MODEL": str(gpt2_dir),
        "SAKER_SERVED_MODEL_NAME": MODEL,
        "SAKER_CHAT_TEMPLATE": TOOL_TEMPLATE,
        "SAKER_JSON_WHITESPACE": "",  # compact JSON for the random tiny model (see tool_app)
        "SAKER_PREFIX_CACHE_TOKENS": "4096",
        "SAKER_THREADS": "8",
    }
    with running(env) as srv:
        yield srv


@pytest.fixture()
def client(gpt2_server):
    return openai_client(gpt2_server)


@pytest.mark.slow
def test_openai_client_create(client):
    done = client.responses.create(model=MODEL, input="Hello there", temperature=0, max_output_tokens=12)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], temperature=0, max_tokens=12
    )
    assert done.object == "response" and done.id.startswith("resp_")
    assert done.output_text == chat.choices[0].message.content and done.output_text
    assert done.usage.output_tokens == chat.usage.completion_tokens
    assert done.usage.input_tokens == chat.usage.prompt_tokens
    listed = client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        temperature=0,
        max_output_tokens=12,
        input=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": [{"type": "input_text", "text": "Count to three."}]},
        ],
    )
    chat = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=12,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Count to three."},
        ],
    )
    assert listed.output_text == chat.choices[0].message.content
    assert listed.instructions == "Be brief." and listed.status in ("completed", "incomplete")


@pytest.mark.slow
def test_openai_client_stream(client):
    """``responses.stream``: the SDK parses every event (it checks item and content indexes as it assembles the
    response); the text deltas add up to the non-streamed answer (greedy)."""
    from openai.types.responses import ResponseTextDeltaEvent

    # the SDK's get_final_response() wants response.completed (an incomplete answer raises): the JSON format
    # makes the random model end its answer
    plain = client.responses.create(
        model=MODEL, input="A city, as JSON", temperature=0, max_output_tokens=80, text=CITY_FORMAT
    )
    assert plain.status == "completed"
    deltas, kinds = [], []
    with client.responses.stream(
        model=MODEL, input="A city, as JSON", temperature=0, max_output_tokens=80, text=CITY_FORMAT
    ) as events:
        for event in events:
            kinds.append(event.type)
            if isinstance(event, ResponseTextDeltaEvent):
                deltas.append(event.delta)
        final = events.get_final_response()
    assert "".join(deltas) == plain.output_text == final.output_text
    assert len(deltas) > 1
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert final.usage.output_tokens == plain.usage.output_tokens
    # create(stream=True): the SDK's typed events, sequence numbers from 0, a cut answer ends incomplete
    events = list(
        client.responses.create(
            model=MODEL, input="Hi", temperature=0, max_output_tokens=5, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


@pytest.mark.slow
def test_openai_client_function_tools(client):
    """Function tools with tool_choice required and named: a function_call with valid arguments, plain and
    streamed (the same call); its function_call_output goes back by previous_response_id and by full input."""
    from openai.types.responses import ResponseFunctionCallArgumentsDeltaEvent

    first = client.responses.create(
        model=MODEL,
        input=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=120,
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), ARGUMENT_SCHEMAS[call.name])
    assert first.status == "completed" and first.tool_choice == "required"
    with client.responses.stream(
        model=MODEL,
        input=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=120,
    ) as events:
        argument_deltas = [e.delta for e in events if isinstance(e, ResponseFunctionCallArgumentsDeltaEvent)]
        streamed = events.get_final_response()
    [streamed_call] = [item for item in streamed.output if item.type == "function_call"]
    assert (streamed_call.name, streamed_call.arguments) == (call.name, call.arguments)
    assert "".join(argument_deltas) == call.arguments
    named = client.responses.create(
        model=MODEL,
        input=QUESTION,
        tools=TOOLS,
        temperature=0,
        tool_choice=GET_TIME,
        parallel_tool_calls=False,
        max_output_tokens=80,
    )
    [call] = [item for item in named.output if item.type == "function_call"]
    assert call.name == "get_time"

    output = {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, sunny"}
    answered = client.responses.create(
        model=MODEL, previous_response_id=named.id, input=[output], tools=TOOLS, temperature=0, max_output_tokens=8
    )
    assert [item.type for item in answered.output] == ["message"]
    stateless = client.responses.create(
        model=MODEL,
        tools=TOOLS,
        temperature=0,
        max_output_tokens=8,
        store=False,
        input=[{"role": "user", "content": QUESTION}, call.model_dump(), output],
    )
    assert stateless.output_text == answered.output_text
    assert stateless.usage.input_tokens == answered.usage.input_tokens


@pytest.mark.slow
def test_openai_client_previous_response_id_reuses_the_prefix_cache(client):
    first = client.responses.create(
        model=MODEL,
        temperature=0,
        max_output_tokens=8,
        input="Once upon a time there was a small model that liked to count.",
    )
    second = client.responses.create(
        model=MODEL, temperature=0, max_output_tokens=8, previous_response_id=first.id, input="One two three four five."
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # the prefix cache shares whole blocks of 16 tokens: every full one of the first request's prompt is reused
    assert second.usage.input_tokens_details.cached_tokens >= (first.usage.input_tokens - 1) // 16 * 16 > 0


@pytest.mark.slow
def test_openai_client_get_and_delete(client):
    import openai

    done = client.responses.create(model=MODEL, input="Hello", temperature=0, max_output_tokens=4)
    got = client.responses.retrieve(done.id)
    assert got.model_dump() == done.model_dump()
    client.responses.delete(done.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(done.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(done.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=done.id)
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=[{"type": "function_call_output", "call_id": "c", "output": "x"}])
    assert err.value.body["param"] == "input"
    assert client.responses.create(model=MODEL, input="Hi", temperature=0, max_output_tokens=1).status == "incomplete"


def run_plain_and_streamed(agent, client, max_turns: int) -> tuple:
    """The Agents SDK's loop run twice, plainly and streamed (with the stream's event kinds), in one event loop that
    closes the client it used."""
    from agents import Runner

    async def run() -> tuple:
        try:
            plain = await Runner.run(agent, QUESTION, max_turns=max_turns)
            streamed = Runner.run_streamed(agent, QUESTION, max_turns=max_turns)
            kinds = [event.type async for event in streamed.stream_events()]
            return plain, streamed, kinds
        finally:
            await client.close()

    return asyncio.run(run())


@pytest.mark.slow
def test_agents_sdk_runs_a_function_tool(gpt2_server):
    """The OpenAI Agents SDK against saker: a forced function call (ModelSettings(tool_choice="required")) runs
    the Python tool; plain and streamed runs (the SDK parses the events). The tiny model's words are random and
    never end before its limit (the SDK takes a response.incomplete as an error), so the run stops on the tool's
    output (tool_use_behavior="stop_on_first_tool"); the whole loop runs on the echo llama below."""
    from agents import ModelSettings

    agent, cities, client = weather_agent(
        gpt2_server.url,
        MODEL,
        tool_use_behavior="stop_on_first_tool",
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=80),
    )

    plain, streamed, kinds = run_plain_and_streamed(agent, client, max_turns=2)
    for result in (plain, streamed):
        assert [item.type for item in result.new_items] == ["tool_call_item", "tool_call_output_item"]
        assert result.final_output.startswith("18 degrees and sunny in ")
    assert len(cities) == 2 and cities[0] == cities[1]
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds


# -- SmolLM2 (a real model) under gunicorn ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_dir(saker_cache):
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import ensure_default_model

    return ensure_default_model(LoadConfig(cache_dir=str(saker_cache)))


@pytest.fixture(scope="module")
def smol_server(smol_dir, saker_cache):
    srv = Gunicorn(
        {"SAKER_CACHE_DIR": str(saker_cache), "SAKER_THREADS": "8", "SAKER_CHAT_TEMPLATE": str(HERMES_TEMPLATE)}
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


class City(__import__("pydantic").BaseModel):
    city: str
    country: str


@pytest.mark.slow
def test_openai_client_parses_a_pydantic_model_on_smollm2(smol_server):
    """``responses.parse(text_format=City)`` sends City's strict JSON schema as text.format; the grammar keeps
    the real model to it and the SDK parses the answer into a City."""
    import openai

    client = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused", max_retries=0)
    done = client.responses.parse(
        model="SmolLM2-135M-Instruct",
        input="What is the capital of Italy?",
        text_format=City,
        temperature=0,
        max_output_tokens=60,
    )
    assert isinstance(done.output_parsed, City) and done.output_parsed.city and done.output_parsed.country
    assert done.status == "completed"
    assert done.text.format.type == "json_schema" and done.text.format.name == "City"


@pytest.mark.slow
def test_a_dropped_stream_stops_its_generation(smol_server):
    """A client that goes away mid-stream: the generation stops early (the server logs how many tokens it made)
    and the next request is answered."""
    before = len(re.findall(r"ended early after \d+ generated tokens", smol_server.output()))
    body = {"input": "Once upon a time", "max_output_tokens": 4000, "ignore_eos": True, "stream": True}
    with requests.post(smol_server.url + "/v1/responses", json=body, stream=True, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines) == b"event: response.created"
        while b"response.output_text.delta" not in next(lines):
            pass
    answer = requests.post(smol_server.url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 2}, timeout=120)
    assert answer.status_code == 200
    deadline, ended = time.time() + 30, []
    while time.time() < deadline and len(ended) <= before:
        ended = [int(n) for n in re.findall(r"ended early after (\d+) generated tokens", smol_server.output())]
        time.sleep(0.2)
    assert len(ended) == before + 1 and ended[-1] < 4000, ended


# -- a tiny model with a long context: the Agents SDK's whole loop and the Codex CLI -------------------------------
CODEX_VERSION = "0.169.0"
ANSWER = "Hello from a tiny model!"
LONG_MODEL = "tiny-long-llama"


def build_echo_llama(path: Path, tokenizer_dir: Path, answer: str, positions: int = 16384) -> Path:
    """A tiny llama (2 layers, 64 wide) with a long context and a real tokenizer (SmolLM2's, so Codex's ~6k-word
    prompt is ~6k tokens), whose next token depends on the last token only: its attention and MLP outputs are
    zero, so the logits are a lookup of the last token's embedding. After a newline it writes ``answer`` and then
    its end token; after anything else, the end token. Certain (logit margins of 80) under any sampling."""
    import torch
    from transformers import AutoTokenizer

    from tooling.tiny_models import llama_model

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    path.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(path)
    chain = [tok.convert_tokens_to_ids("Ċ"), *tok.encode(answer, add_special_tokens=False)]
    hidden = 64
    assert len(set(chain)) == len(chain) < hidden - 1 and tok.eos_token_id not in chain
    model = llama_model(tok, width=hidden, positions=positions, initializer_range=0.02)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed.zero_()
        head.zero_()
        embed[:, hidden - 1] = 1.0  # any other token: the "end" direction
        head[tok.eos_token_id, hidden - 1] = 10.0
        for i, token in enumerate(chain):
            embed[token] = 0.0
            embed[token, i] = 1.0
            head[chain[i + 1] if i + 1 < len(chain) else tok.eos_token_id, i] = 10.0
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def codex_bin() -> Path:
    """The Codex CLI, installed once with npm into the repo's ignored .cache/codex."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: the Codex CLI test needs it")
    folder = ROOT / ".cache" / "codex"
    binary = folder / "node_modules" / ".bin" / "codex"
    installed = folder / "node_modules" / "@openai" / "codex" / "package.json"
    if not (binary.exists() and installed.exists() and json.loads(installed.read_text())["version"] == CODEX_VERSION):
        folder.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [
                npm,
                "install",
                "--prefix",
                str(folder),
                "--no-audit",
                "--no-fund",
                "--loglevel=error",
                f"@openai/codex@{CODEX_VERSION}",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0 or not binary.exists():
            pytest.skip(f"npm install @openai/codex@{CODEX_VERSION} failed: {(done.stderr or done.stdout)[-800:]}")
    return binary


@pytest.fixture(scope="module")
def long_server(tmp_path_factory, smol_dir):
    model = build_echo_llama(tmp_path_factory.mktemp("models") / "tiny-long-llama", smol_dir, ANSWER)
    srv = Gunicorn(
        {
            "SAKER_MODEL": str(model),
            "SAKER_SERVED_MODEL_NAME": LONG_MODEL,
            "SAKER_CHAT_TEMPLATE": str(HERMES_TEMPLATE),
            "SAKER_THREADS": "8",
            "SAKER_LOG_FORMAT": "json",  # the access lines read below are JSON objects
        }
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.mark.slow
def test_agents_sdk_runs_its_whole_loop(long_server):
    """The Agents SDK's whole loop, plain and streamed: the forced call (the grammar writes it: the shipped Hermes
    template renders the tool) runs the Python tool, the SDK sends the call and its output back as input items,
    tool_choice goes back to auto and the model answers (the echo llama's answer, which ends: completed)."""
    from agents import ModelSettings

    agent, cities, client = weather_agent(
        long_server.url,
        LONG_MODEL,
        model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=100),
    )

    plain, streamed, kinds = run_plain_and_streamed(agent, client, max_turns=4)
    for result in (plain, streamed):
        items = [item.type for item in result.new_items]
        assert items == ["tool_call_item", "tool_call_output_item", "message_output_item"], items
        assert result.final_output == ANSWER
    assert len(cities) == 2 and "raw_response_event" in kinds


def codex_config(base_url: str) -> str:
    return f"""model = "{LONG_MODEL}"
model_provider = "saker"

[model_providers.saker]
name = "saker"
base_url = "{base_url}"
wire_api = "responses"
env_key = "SAKER_API_KEY"
"""


@pytest.mark.slow
def test_codex_exec_against_saker(codex_bin, long_server, tmp_path):
    """``codex exec "Say hello"`` with saker as a custom provider: Codex sends its whole agent prompt (instructions,
    developer and user messages, its tools) as a streamed Responses request, reads the events and prints the
    model's answer; it exits 0."""
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(codex_config(long_server.url + "/v1"))
    env = {**os.environ, "CODEX_HOME": str(home), "SAKER_API_KEY": "unused", "NO_COLOR": "1"}
    done = subprocess.run(
        [
            str(codex_bin),
            "exec",
            "--skip-git-repo-check",
            "--output-last-message",
            str(tmp_path / "last.txt"),
            "Say hello",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )
    log = long_server.output()
    assert done.returncode == 0, f"codex exited {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}\n{log[-4000:]}"
    assert ANSWER in done.stdout
    assert (tmp_path / "last.txt").read_text().strip() == ANSWER
    served = [
        json.loads(line) for line in log.splitlines() if line.startswith("{") and '"route":"/v1/responses"' in line
    ]
    assert served and all(r["status"] == 200 for r in served), served
    assert max(r["prompt_tokens"] for r in served) > 2000  # Codex's agent prompt, tools included
