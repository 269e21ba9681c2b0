"""The tool-call reader as a stream (no model): ``ToolCallStream`` fed in pieces gives content and call deltas as
the text comes (a call's first delta with its id and name and no arguments, then pieces of its arguments), and
the deltas add up to the calls a whole answer gives. References are the arguments' own JSON (``json.dumps`` of the
value the test wrote, ``json.loads`` of what comes back), never an earlier output of the reader."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.tool_calls import CallDelta, HermesFormat, ToolCallStream, read_all

FMT = HermesFormat()


def call_text(name: str, arguments: dict | str, sep: str = "\n") -> str:
    return f'<tool_call>{sep}{{"name": {json.dumps(name)}, "arguments": {json.dumps(arguments)}}}{sep}</tool_call>'


def feed_pieces(text: str, pieces: list[int] | int) -> tuple[list[str], list[list[CallDelta]], ToolCallStream]:
    """Feed ``text`` cut at the given sizes (one size: all pieces that long); returns the content and the deltas
    released by each feed (the last entry is ``finish()``'s) and the reader."""
    stream = ToolCallStream(FMT)
    sizes = pieces if isinstance(pieces, list) else [pieces] * (len(text) // pieces + 1)
    contents, deltas, at = [], [], 0
    for size in sizes:
        if at >= len(text):
            break
        content, more = stream.feed(text[at : at + size])
        contents.append(content)
        deltas.append(more)
        at += size
    assert at >= len(text)
    content, more = stream.finish()
    contents.append(content)
    deltas.append(more)
    return contents, deltas, stream


def assemble(deltas: list[CallDelta]) -> list[tuple[str, str, str]]:
    """(id, name, arguments) per call, as a client assembles deltas; checks each delta's shape on the way."""
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        if delta.name is not None:
            assert delta.index == len(calls), "calls start in order, each once"
            assert delta.arguments == "" and delta.id and delta.id.startswith("call_")
            assert delta.as_openai() == {
                "index": delta.index,
                "id": delta.id,
                "type": "function",
                "function": {"name": delta.name, "arguments": ""},
            }
            calls[delta.index] = [delta.id, delta.name, ""]
        else:
            assert delta.index in calls, "arguments come after their call's first delta"
            assert delta.arguments, "no empty argument deltas"
            assert delta.as_openai() == {"index": delta.index, "function": {"arguments": delta.arguments}}
            calls[delta.index][2] += delta.arguments
    return [tuple(calls[i]) for i in sorted(calls)]


def flat(deltas: list[list[CallDelta]]) -> list[CallDelta]:
    return [d for feed in deltas for d in feed]


ARGUMENTS = {"city": "Paris", "unit": "c"}


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11])
def test_arguments_stream_in_pieces_that_join_to_the_written_arguments(size):
    text = call_text("get_weather", ARGUMENTS)
    contents, deltas, stream = feed_pieces(text, size)
    [(call_id, name, arguments)] = assemble(flat(deltas))
    assert (name, arguments) == ("get_weather", json.dumps(ARGUMENTS))
    assert json.loads(arguments) == ARGUMENTS
    assert "".join(contents) == ""
    fragments = [d for d in flat(deltas) if d.name is None]
    assert len(fragments) >= len(json.dumps(ARGUMENTS)) // size - 1, "arguments go out as they come"
    # the whole answer read at once says the same
    content, [whole] = read_all(FMT, text)
    assert content is None and (whole.name, whole.arguments) == (name, arguments)
    assert [(c.id, c.name, c.arguments) for c in stream.calls] == [(call_id, name, arguments)]


def test_the_opening_tag_split_anywhere_is_found():
    text = "Sure." + call_text("get_time", {"zone": 2})
    for cut in range(len(text) + 1):
        contents, deltas, _ = feed_pieces(text, [cut, len(text)] if cut else [len(text)])
        assert "".join(contents) == "Sure."
        assert [(n, json.loads(a)) for _, n, a in assemble(flat(deltas))] == [("get_time", {"zone": 2})]


def test_text_before_a_call_goes_out_before_the_call_and_only_a_possible_tag_waits():
    stream = ToolCallStream(FMT)
    assert stream.feed("Let me check") == ("Let me check", [])
    assert stream.feed(".\n<tool") == (".", [])  # the newline waits for content, "<tool" for the tag
    assert stream.feed("_call>\n{") == ("", [])
    content, deltas = stream.feed('"name": "get_time", "arguments": {"zo')
    assert content == ""
    assert [(d.name, d.arguments) for d in deltas] == [("get_time", ""), (None, '{"zo')]
    assert stream.feed('ne"') == ("", [CallDelta(0, 'ne"')])
    assert stream.feed(": 3}}\n</tool_call>") == ("", [CallDelta(0, ": 3}")])
    assert stream.finish() == ("", [])
    assert [(c.name, c.arguments) for c in stream.calls] == [("get_time", '{"zone": 3}')]


def test_nothing_of_a_call_goes_out_before_its_name_and_arguments_are_begun():
    stream = ToolCallStream(FMT)
    for piece in ["<tool_call>", "\n", '{"name"', ': "get_time"', ", ", '"arguments"', ": "]:
        assert stream.feed(piece) == ("", []), piece
    _, deltas = stream.feed("{")
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(0, "get_time", ""), (0, None, "{")]


TRICKY = {
    "q": 'a}"{ ] [ \\" , : <tool_call> </tool_call> \\u00e9',
    "nested": {"list": [1, {"deep": ["}", "{"]}], "empty": {}},
    "é": "naïve ☃ 😀",
    "n": -1.5e3,
    "t": True,
    "z": None,
}


@pytest.mark.parametrize("size", [1, 2, 4, 9])
@pytest.mark.parametrize("ensure_ascii", [True, False])
def test_arguments_with_braces_quotes_tags_and_escapes_inside_strings(size, ensure_ascii):
    arguments = json.dumps(TRICKY, ensure_ascii=ensure_ascii)
    text = '<tool_call>\n{"name": "search", "arguments": ' + arguments + "}\n</tool_call>\nDone."
    contents, deltas, _ = feed_pieces(text, size)
    [(_, name, got)] = assemble(flat(deltas))
    assert name == "search" and got == arguments and json.loads(got) == TRICKY
    assert "".join(contents) == "Done."


@pytest.mark.parametrize("size", [1, 2, 3, 6])
def test_arguments_given_as_a_json_string_stream_decoded(size):
    """``"arguments": "{\\"zone\\": 2}"`` (a JSON text in a string): the pieces are the decoded text, never half
    an escape, and they join to the decoded string."""
    inner = json.dumps({"text": 'é "quoted" \\ 😀 \n end'}, ensure_ascii=True)
    text = call_text("note", inner)
    contents, deltas, _ = feed_pieces(text, size)
    [(_, name, got)] = assemble(flat(deltas))
    assert (name, got) == ("note", inner)
    assert "".join(contents) == ""


def test_keys_in_another_order_and_parameters_and_no_arguments():
    text = (
        '<tool_call>{"arguments": {"a": [1, 2]}, "name": "late"}</tool_call>'
        '<tool_call>{"name": "alias", "parameters": {"b": "x"}}</tool_call>'
        '<tool_call>{"name": "bare"}</tool_call>'
    )
    for size in (1, 3, len(text)):
        contents, deltas, _ = feed_pieces(text, size)
        calls = assemble(flat(deltas))
        assert [(n, json.loads(a)) for _, n, a in calls] == [
            ("late", {"a": [1, 2]}),
            ("alias", {"b": "x"}),
            ("bare", {}),
        ]
        assert "".join(contents) == ""


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_several_calls_each_under_its_own_index_with_text_between(size):
    first, second = {"city": "Paris", "unit": "c"}, {"zone": -3}
    one, two = call_text("get_weather", first), call_text("get_time", second)
    text = "Checking both.\n" + one + "\n" + two + "\nBye."
    contents, deltas, stream = feed_pieces(text, size)
    calls = assemble(flat(deltas))
    assert [(n, a) for _, n, a in calls] == [("get_weather", json.dumps(first)), ("get_time", json.dumps(second))]
    assert len({i for i, _, _ in calls}) == 2
    content = text.replace(one, "").replace(two, "").strip()  # the documented rule: the text outside calls, stripped
    assert "".join(contents) == content == read_all(FMT, text)[0]
    if size == 1:  # the second call's first delta comes after all of the first call's arguments
        indexes = [d.index for d in flat(deltas)]
        assert indexes == sorted(indexes)


def test_a_call_cut_inside_its_arguments_stays_a_call_with_what_was_written():
    """max_tokens inside a call: the call was already announced; its arguments are what the model wrote."""
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1'
    contents, deltas, stream = feed_pieces(text, 2)
    [(_, name, arguments)] = assemble(flat(deltas))
    assert (name, arguments) == ("get_time", '{"zone": 1')
    assert "".join(contents) == ""
    content, [call] = read_all(FMT, text)
    assert content is None and call.arguments == '{"zone": 1'


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
        '<tool_call>\n{"name": "get_time", "argu',
        "<tool_call>[1, 2]</tool_call>",
    ],
)
def test_a_body_that_never_becomes_a_call_is_content_with_its_tags(text):
    for size in (1, 3, len(text)):
        contents, deltas, _ = feed_pieces(text, size)
        assert flat(deltas) == [] and "".join(contents) == text.strip()


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet=st.sampled_from('ab{}[]"\\:,< /é😀\n')),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None)
@given(
    before=st.text(alphabet=st.sampled_from("ab <>\n"), max_size=6),
    calls=st.lists(st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=3), min_size=1, max_size=3),
    ensure_ascii=st.booleans(),
    cuts=st.lists(st.integers(min_value=1, max_value=9), min_size=1, max_size=40),
)
def test_any_arguments_cut_anywhere_join_to_the_written_arguments(before, calls, ensure_ascii, cuts):
    written = [json.dumps(arguments, ensure_ascii=ensure_ascii) for arguments in calls]
    text = before + "".join(
        '<tool_call>\n{"name": "f%d", "arguments": %s}\n</tool_call>' % (i, w) for i, w in enumerate(written)
    )
    sizes = (cuts * (len(text) // sum(cuts) + 1))[: len(text)]
    contents, deltas, _ = feed_pieces(text, sizes)
    got = assemble(flat(deltas))
    assert [(n, a) for _, n, a in got] == [(f"f{i}", w) for i, w in enumerate(written)]
    assert [json.loads(a) for _, _, a in got] == calls
    assert "".join(contents) == before.strip()
