"""Tool calling in chat: the hermes reader (no model), tools through a template that renders them, tool_choice
required/named forced by the grammar (arguments valid against the function's schema), auto read out of the
answer, streamed tool-call deltas equal to the plain answer, history with calls, and every bad input a 400.

The tiny GPT-2 gets a Hermes-style template (TOOL_TEMPLATE); the tiny llama's own template ignores tools."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tooling.sse import iter_json
from conftest import make_settings

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {% for tool in tools %}{{ tool.function.name }} {% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    '{% for c in m.tool_calls %}<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


# -- the reader (no model) -------------------------------------------------------------------------------------
from app.tool_calls import HermesFormat, ToolCallStream, read_all  # noqa: E402

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
READS = [
    ("Plain answer.", "Plain answer.", []),
    (CALL, None, [("get_weather", {"city": "Paris", "unit": "c"})]),
    (
        "Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Rome"),
        "Let me check.",
        [("get_weather", {"city": "Paris", "unit": "c"}), ("get_weather", {"city": "Rome", "unit": "c"})],
    ),
    (CALL + "\nDone.", "Done.", [("get_weather", {"city": "Paris", "unit": "c"})]),
    ("A\n" + CALL + "\n\nB  ", "A\n\n\nB", [("get_weather", {"city": "Paris", "unit": "c"})]),
    ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}', None, [("get_time", {"zone": 1})]),
    (
        '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": 2}"}\n</tool_call>',
        None,
        [("get_time", {"zone": 2})],
    ),
    ("x <tool_ca", "x <tool_ca", []),
    ('<tool_call>\n{"name": "get_time", "argu', '<tool_call>\n{"name": "get_time", "argu', []),
]


@pytest.mark.parametrize("text, content, calls", READS)
def test_reader(text, content, calls):
    got_content, got_calls = read_all(HermesFormat(), text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("text, content, calls", READS)
def test_reader_fed_in_pieces_gives_the_same(text, content, calls):
    for size in (1, 2, 3, 7):
        stream = ToolCallStream(HermesFormat())
        parts = []
        for at in range(0, len(text), size):
            piece, _ = stream.feed(text[at : at + size])
            parts.append(piece)
        tail, _ = stream.finish()
        assert ("".join(parts) + tail or None) == content
        assert [(c.name, json.loads(c.arguments)) for c in stream.calls] == calls


# -- served ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tool_client(gpt2_dir, gpt2_worker):
    from app import create_app

    app = create_app(
        make_settings(
            model=str(gpt2_dir),
            served_model_name="tiny-gpt2",
            chat_template=TOOL_TEMPLATE,
            json_whitespace="",  # a random tiny model writes whitespace wherever a grammar allows it
        ),
        worker=gpt2_worker,
    )
    app.config["TESTING"] = True
    return app.test_client()


def chat(client, **body):
    resp = client.post(
        "/v1/chat/completions",
        json={"model": "tiny-gpt2", "messages": MESSAGES, "temperature": 0, "max_tokens": 120, **body},
    )
    assert resp.status_code == 200, resp.get_data(as_text=True)
    return resp.get_json()


def stream_frames(client, **body) -> bytes:
    """The SSE bytes of a streamed chat request (``chat``'s defaults)."""
    resp = client.post(
        "/v1/chat/completions",
        json={"model": "tiny-gpt2", "messages": MESSAGES, "temperature": 0, "max_tokens": 120, "stream": True, **body},
    )
    assert resp.status_code == 200, resp.get_data(as_text=True)
    return resp.get_data()


def streamed(client, **body) -> tuple[str, list[dict], list[str]]:
    """(content, tool calls assembled from their deltas as the openai client does, finish reasons)."""
    content, calls, reasons = "", {}, []
    for chunk in iter_json(stream_frames(client, **body)):
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                slot = calls.setdefault(
                    call["index"], {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                )
                slot["id"] += call.get("id") or ""
                slot["function"]["name"] += call.get("function", {}).get("name") or ""
                slot["function"]["arguments"] += call.get("function", {}).get("arguments") or ""
            if choice["finish_reason"]:
                reasons.append(choice["finish_reason"])
    return content, [calls[i] for i in sorted(calls)], reasons


def assert_valid_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        name = call["function"]["name"]
        assert name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


def test_tools_reach_the_template(tool_client):
    plain = chat(tool_client, max_tokens=1)["usage"]["prompt_tokens"]
    with_tools = chat(tool_client, max_tokens=1, tools=TOOLS)["usage"]["prompt_tokens"]
    without = chat(tool_client, max_tokens=1, tools=TOOLS, tool_choice="none")["usage"]["prompt_tokens"]
    assert with_tools > plain + 5 and without == plain


def test_required_answers_with_valid_calls(tool_client):
    body = chat(
        tool_client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=7, n=3
    )
    for choice in body["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] is None
        assert len(choice["message"]["tool_calls"]) == 1
        assert_valid_calls(choice["message"]["tool_calls"])


def whole_calls(choice: dict) -> list[dict]:
    """The calls of a choice but one cut by max_tokens: an answer cut inside a call keeps that call with the
    arguments written so far (as OpenAI's do), which are no whole JSON."""
    calls = choice["message"]["tool_calls"]
    if choice["finish_reason"] == "length" and calls:
        try:
            json.loads(calls[-1]["function"]["arguments"])
        except ValueError:
            return calls[:-1]
    return calls


PARALLEL = dict(tools=TOOLS, tool_choice="required", temperature=1.0, seed=7, max_tokens=150)


def test_parallel_calls_are_each_valid(tool_client):
    """parallel_tool_calls (the default) lets the model add calls: the random tiny model adds them until
    max_tokens, so the answer may end in a cut call; every whole call is valid."""
    body = chat(tool_client, n=3, **PARALLEL)
    for choice in body["choices"]:
        assert choice["finish_reason"] in ("tool_calls", "length"), choice
        assert_valid_calls(whole_calls(choice))


def test_named_function_is_the_one_called(tool_client):
    choice = chat(tool_client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})[
        "choices"
    ][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_time"]
    assert_valid_calls(choice["message"]["tool_calls"], ["get_time"])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize(
    "fmt",
    [
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "list", "schema": {"type": "array"}}}},
        {"structured_outputs": {"regex": "[0-9]+"}},
    ],
    ids=["json_object", "json_schema", "structured_outputs"],
)
def test_a_forced_call_with_a_response_format_is_the_call(tool_client, choice, fmt):
    """A forced call with a format for the final message (instructor's RESPONSES_TOOLS mode sends a named call with
    a schema): the answer is the call, its arguments valid against the function's schema, not the format (here an
    array or digits, which no call could be)."""
    body = chat(tool_client, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, **fmt)
    answer = body["choices"][0]
    assert answer["finish_reason"] == "tool_calls" and answer["message"]["content"] is None, answer
    names = ["get_weather"] if isinstance(choice, dict) else None
    assert len(answer["message"]["tool_calls"]) == 1
    assert_valid_calls(answer["message"]["tool_calls"], names)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_equal_the_plain_answer(tool_client, choice):
    plain = chat(tool_client, tools=TOOLS, tool_choice=choice)["choices"][0]
    content, calls, reasons = streamed(tool_client, tools=TOOLS, tool_choice=choice)
    assert reasons == [plain["finish_reason"]] and (content or None) == plain["message"]["content"]
    frames = stream_frames(tool_client, tools=TOOLS, tool_choice=choice)
    deltas = [c["choices"] for c in iter_json(frames)]
    assert all(c[0]["delta"] or c[0]["finish_reason"] for c in deltas[1:]), "no empty chunks inside a call"
    strip = [{**c, "id": None} for c in calls]
    assert strip == [{**c, "id": None} for c in plain["message"]["tool_calls"]]


def call_entries(frames: bytes) -> list[dict]:
    """The ``tool_calls`` delta entries of a stream's chunks, in order (one choice), checking that a chunk names
    each call at most once."""
    entries = []
    for chunk in iter_json(frames):
        for choice in chunk["choices"]:
            mine = choice["delta"].get("tool_calls") or []
            assert len({e["index"] for e in mine}) == len(mine), chunk
            entries += mine
    return entries


def check_streamed_arguments(entries: list[dict], plain_calls: list[dict]) -> None:
    """Each call's first entry has index, id, type and name with ``arguments: ""``; the later ones only index and
    a piece of the arguments (more than one piece per call); the pieces join to the plain answer's arguments."""
    assert plain_calls
    for index, want in enumerate(plain_calls):
        mine = [e for e in entries if e["index"] == index]
        first, rest = mine[0], mine[1:]
        assert first["id"].startswith("call_") and first["type"] == "function"
        assert first["function"] == {"name": want["function"]["name"], "arguments": ""}
        assert all(set(e) == {"index", "function"} and set(e["function"]) == {"arguments"} for e in rest), rest
        assert len(rest) > 1, f"the arguments of call {index} came in one piece"
        assert "".join(e["function"]["arguments"] for e in rest) == want["function"]["arguments"]
    assert {e["index"] for e in entries} == set(range(len(plain_calls)))
    first_of = [next(i for i, e in enumerate(entries) if e["index"] == k) for k in range(len(plain_calls))]
    assert first_of == sorted(first_of), "calls start in order"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_call_streams_its_arguments_in_pieces(tool_client, choice):
    fields = dict(tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    plain = chat(tool_client, **fields)["choices"][0]
    assert plain["finish_reason"] == "tool_calls"
    json.loads(plain["message"]["tool_calls"][0]["function"]["arguments"])  # the reference is whole JSON
    frames = stream_frames(tool_client, stream_options={"include_usage": True}, **fields)
    check_streamed_arguments(call_entries(frames), plain["message"]["tool_calls"])
    chunks = list(iter_json(frames))
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == chat(tool_client, **fields)["usage"]


def test_parallel_calls_stream_each_under_its_own_index(tool_client):
    """Several calls in one (seeded) answer: each streams under its own index, its arguments in pieces that join to
    the plain answer's; a call cut by max_tokens is cut alike in both."""
    plain = chat(tool_client, **PARALLEL)["choices"][0]
    assert len(plain["message"]["tool_calls"]) > 1, "the seeded tiny model writes several calls"
    frames = stream_frames(tool_client, **PARALLEL)
    check_streamed_arguments(call_entries(frames), plain["message"]["tool_calls"])


AUTO_CALL = (
    r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Oslo", "unit": "f"\}\}\n</tool_call>'
)


def test_auto_reads_calls_out_of_the_answer_plain_and_streamed(tool_client):
    """The tiny model never calls a tool by itself: a regex makes it write one, the reader finds it."""
    fields = dict(tools=TOOLS, tool_choice="auto", structured_outputs={"regex": AUTO_CALL})
    choice = chat(tool_client, **fields)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Sure."
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "f"}'}
    content, calls, reasons = streamed(tool_client, **fields)
    assert content == "Sure." and reasons == ["tool_calls"]
    assert [c["function"] for c in calls] == [call["function"]]
    # the text before the call goes out as content, before the call's first delta
    frames = stream_frames(tool_client, **fields)
    kinds = [
        kind
        for chunk in iter_json(frames)
        for choice in chunk["choices"]
        for kind in ("content", "tool_calls")
        if choice["delta"].get(kind)
    ]
    assert kinds[0] == "content" and "content" not in kinds[kinds.index("tool_calls") :]
    check_streamed_arguments(call_entries(frames), [call])


def test_auto_without_a_call_is_plain_content(tool_client):
    plain = chat(tool_client, max_tokens=12)["choices"][0]["message"]["content"]
    choice = chat(tool_client, max_tokens=12, tools=TOOLS, structured_outputs={"regex": "[a-z ]{5,20}"})["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] in ("stop", "length")
    assert choice["message"]["content"] and plain is not None


def test_tokenize_renders_tools_as_chat_does(tool_client):
    def count(**extra):
        resp = tool_client.post("/tokenize", json={"model": "tiny-gpt2", "messages": MESSAGES, **extra})
        assert resp.status_code == 200, resp.get_data(as_text=True)
        return resp.get_json()["count"]

    assert count(tools=TOOLS) == chat(tool_client, max_tokens=1, tools=TOOLS)["usage"]["prompt_tokens"]
    assert count(tools=TOOLS) > count()


def history(arguments: str) -> list[dict]:
    """MESSAGES, then an assistant's call of get_weather with these arguments and the tool's answer."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]


def test_history_with_calls_and_tool_answers_renders(tool_client):
    messages = history('{"city": "Paris", "unit": "c"}')
    short = chat(tool_client, tools=[TIME], max_tokens=1)["usage"]["prompt_tokens"]
    body = chat(tool_client, tools=[TIME], messages=messages, max_tokens=1)
    assert body["usage"]["prompt_tokens"] > short + 30


PLAIN_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_tools_on_a_template_without_tool_support_go_into_the_system_message(gpt2_dir, gpt2_worker):
    """A template that ignores tools: the tools are written into the system message in the call format's words
    (each signature as JSON, the <tool_call> tags), earlier calls as the assistant's text and tool results as
    <tool_response> user messages."""
    from app import create_app

    app = create_app(
        make_settings(model=str(gpt2_dir), served_model_name="tiny-gpt2", chat_template=PLAIN_TEMPLATE),
        worker=gpt2_worker,
    )
    client = app.test_client()
    messages = history('{"city": "Oslo"}')
    resp = client.post("/tokenize", json={"model": "tiny-gpt2", "messages": messages, "tools": TOOLS})
    assert resp.status_code == 200, resp.get_data(as_text=True)
    text = gpt2_worker.tokenizer.decode(resp.get_json()["tokens"])
    assert text.startswith("<|system|>You can call functions.")
    for tool in TOOLS:
        assert f'"name": "{tool["function"]["name"]}"' in text and json.dumps(tool["function"]["parameters"]) in text
    assert '<|assistant|><tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<|user|><tool_response>\n18 degrees, sunny\n</tool_response>" in text
    # chat with tool_choice none leaves the tools out (a call on this path is answered on the embedded model's own
    # template: tests/live/test_smollm2_server.py; the tiny models' 256 positions do not hold the tool block)
    body = {"model": "tiny-gpt2", "messages": MESSAGES, "max_tokens": 1}
    plain = client.post("/v1/chat/completions", json=body).get_json()
    none = client.post("/v1/chat/completions", json={**body, "tools": TOOLS, "tool_choice": "none"}).get_json()
    assert none["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]


BAD = [
    ("tool-without-name", {"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools"),
    ("tool-bad-name", {"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools"),
    ("tool-unknown-type", {"tools": [{"type": "web_search", "function": {"name": "x"}}]}, "tools"),
    (
        "tool-parameters-not-object",
        {"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "string"}}}]},
        "tools",
    ),
    ("tool-names-twice", {"tools": [WEATHER, WEATHER]}, "tools"),
    (
        "tool-bad-schema",
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "x",
                        "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                    },
                }
            ],
            "tool_choice": "required",
        },
        "tools",
    ),
    (
        "choice-unknown-function",
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ("choice-unknown-string", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ("required-without-tools", {"tool_choice": "required"}, "tool_choice"),
    (
        "call-without-function",
        {"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function"}]}]},
        "messages",
    ),
]


@pytest.mark.parametrize("name, fields, param", BAD, ids=[b[0] for b in BAD])
def test_bad_tool_requests_are_400_and_the_server_keeps_serving(tool_client, name, fields, param):
    resp = tool_client.post("/v1/chat/completions", json={"model": "tiny-gpt2", "messages": MESSAGES, **fields})
    assert resp.status_code == 400, resp.get_data(as_text=True)
    error = resp.get_json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    assert chat(tool_client, max_tokens=1)["choices"][0]["finish_reason"] == "length"


def tokens_into_the_arguments(client, **fields) -> int:
    """A max_tokens that cuts the greedy answer a token or two into its call's arguments (found from the whole
    answer's tokens)."""
    full = chat(client, logprobs=True, **fields)["choices"][0]
    text = ""
    for k, entry in enumerate(full["logprobs"]["content"]):
        text += entry["token"]
        if '"arguments": {"' in text:
            return k + 2
    raise AssertionError(f"no arguments in {text!r}")


def test_a_call_cut_by_max_tokens_is_cut_alike_plain_and_streamed(tool_client):
    """max_tokens inside a call's arguments: the call stays, with the arguments written so far (a prefix of the
    whole answer's), finish_reason length; the stream sends the same pieces."""
    fields = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = chat(tool_client, **fields)["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    cut = tokens_into_the_arguments(tool_client, **fields)
    plain = chat(tool_client, max_tokens=cut, **fields)["choices"][0]
    assert plain["finish_reason"] == "length" and plain["message"]["content"] is None
    [call] = plain["message"]["tool_calls"]
    arguments = call["function"]["arguments"]
    assert arguments and whole.startswith(arguments) and arguments != whole
    content, calls, reasons = streamed(tool_client, max_tokens=cut, **fields)
    assert reasons == ["length"] and content == ""
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("get_weather", arguments)]


def in_process_openai(client):
    """The official client talking to the Flask app in this process (httpx's WSGI transport), no server."""
    import httpx
    import openai

    transport = httpx.WSGITransport(app=client.application)
    return openai.OpenAI(
        base_url="http://saker.test/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(transport=transport, base_url="http://saker.test"),
    )


def test_openai_client_stream_helper_sees_the_arguments_grow(tool_client):
    """The official client's ``chat.completions.stream``: ``tool_calls.function.arguments.delta`` events come one
    per piece, each with the arguments so far, and (the tool being ``strict``) partial ``parsed_arguments`` that
    grow into the plain answer's arguments."""
    client = in_process_openai(tool_client)
    strict = [{**WEATHER, "function": {**WEATHER["function"], "strict": True}}]
    fields = dict(
        model="tiny-gpt2",
        messages=MESSAGES,
        tools=strict,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=120,
    )
    plain = client.chat.completions.create(**fields).choices[0].message.tool_calls[0]
    want = json.loads(plain.function.arguments)
    with client.chat.completions.stream(**fields) as stream:
        events = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    assert len(events) > 1
    assert "".join(e.arguments_delta for e in events) == plain.function.arguments
    assert all(e.name == "get_weather" and e.index == 0 for e in events)
    assert all(b.arguments.startswith(a.arguments) for a, b in zip(events, events[1:]))
    partials = [e.parsed_arguments for e in events if e.parsed_arguments]
    assert len({json.dumps(p, sort_keys=True) for p in partials}) > 1, "the parsed arguments grow"
    assert partials[-1] == want
    [call] = final.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", plain.function.arguments)
    assert call.function.parsed_arguments == want
    assert final.choices[0].finish_reason == "tool_calls"


def test_openai_client_chunks_accumulate_to_the_plain_calls(tool_client):
    """Raw ``ChatCompletionChunk``s from ``create(stream=True)``, accumulated as OpenAI's cookbook does (first
    delta: id and name; later: arguments by index), equal the plain answer's calls, several of them."""
    client = in_process_openai(tool_client)
    fields = dict(model="tiny-gpt2", messages=MESSAGES, **PARALLEL)
    plain = client.chat.completions.create(**fields).choices[0]
    calls: dict[int, dict] = {}
    pieces = 0
    for chunk in client.chat.completions.create(**fields, stream=True):
        for delta_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if delta_call.id:
                calls[delta_call.index] = {"id": delta_call.id, "name": delta_call.function.name, "arguments": ""}
            else:
                pieces += 1
            calls[delta_call.index]["arguments"] += delta_call.function.arguments or ""
    want = [(c.function.name, c.function.arguments) for c in plain.message.tool_calls]
    assert len(want) > 1 and pieces > len(want)
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == want


def test_langchain_tool_call_chunks_are_incremental(tool_client):
    """LangChain's ``bind_tools`` with a forced tool: the streamed ``tool_call_chunks`` come in several pieces and
    add up to the plain answer's call."""
    pytest.importorskip("langchain_openai")
    import httpx
    from langchain_openai import ChatOpenAI

    transport = httpx.WSGITransport(app=tool_client.application)
    model = ChatOpenAI(
        model="tiny-gpt2",
        base_url="http://saker.test/v1",
        api_key="unused",
        temperature=0,
        max_tokens=120,
        max_retries=0,
        http_client=httpx.Client(transport=transport, base_url="http://saker.test"),
    ).bind_tools([WEATHER], tool_choice="get_weather")
    plain = model.invoke("What is the weather in Paris?")
    chunks = list(model.stream("What is the weather in Paris?"))
    with_args = [c for c in chunks if any(t.get("args") for t in c.tool_call_chunks)]
    assert len(with_args) > 1
    total = chunks[0]
    for chunk in chunks[1:]:
        total += chunk
    assert [(t["name"], t["args"]) for t in total.tool_calls] == [(t["name"], t["args"]) for t in plain.tool_calls]


@pytest.mark.slow
def test_openai_client_tool_calls_under_gunicorn(gpt2_dir):
    """The official client against a real gunicorn: required and named tool choices come back as parsed
    ``tool_calls`` with valid arguments, plain and streamed (the client assembles the deltas)."""
    import openai
    from servers import Gunicorn

    srv = Gunicorn(
        {
            "SAKER_MODEL": str(gpt2_dir),
            "SAKER_SERVED_MODEL_NAME": "tiny-gpt2",
            "SAKER_CHAT_TEMPLATE": TOOL_TEMPLATE,
            "SAKER_JSON_WHITESPACE": "",  # compact JSON for the random tiny model (see tool_client)
        }
    )
    try:
        srv.wait_ready()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice in ("required", named):
            done = client.chat.completions.create(
                model="tiny-gpt2",
                messages=MESSAGES,
                tools=TOOLS,
                tool_choice=choice,
                parallel_tool_calls=False,
                temperature=0,
                max_tokens=120,
            )
            message = done.choices[0].message
            assert done.choices[0].finish_reason == "tool_calls" and message.content is None
            assert_valid_calls([call.model_dump() for call in message.tool_calls])
            with client.chat.completions.stream(
                model="tiny-gpt2",
                messages=MESSAGES,
                tools=TOOLS,
                tool_choice=choice,
                parallel_tool_calls=False,
                temperature=0,
                max_tokens=120,
            ) as stream:
                final = stream.get_final_completion()
            streamed = final.choices[0].message.tool_calls
            assert [(c.function.name, c.function.arguments) for c in streamed] == [
                (c.function.name, c.function.arguments) for c in message.tool_calls
            ]
    finally:
        srv.stop()


def test_the_shipped_hermes_template_renders_tools_and_a_broken_one_says_so(gpt2_dir, gpt2_worker):
    from pathlib import Path

    from app import create_app

    shipped = Path(__file__).resolve().parents[2] / "deploy" / "chat-templates" / "smollm2-hermes-tools.jinja"
    for template, status, param in ((str(shipped), 200, None), ("{% if tools %}unclosed", 400, "messages")):
        app = create_app(
            make_settings(model=str(gpt2_dir), served_model_name="tiny-gpt2", chat_template=template),
            worker=gpt2_worker,
        )
        resp = app.test_client().post("/tokenize", json={"model": "tiny-gpt2", "messages": MESSAGES, "tools": [TIME]})
        assert resp.status_code == status, resp.get_data(as_text=True)
        if param:
            assert resp.get_json()["error"]["param"] == param
            assert "could not render" in resp.get_json()["error"]["message"]
