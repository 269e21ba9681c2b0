"""Tool calls in a chat model's own format: the grammar that forces them (``tool_choice`` required or named) and
the reader that finds them in the generated text as it comes (plain and streamed alike). No torch here.

The format is a setting (``SAKER_TOOL_CALL_PARSER``); ``hermes`` is the ``<tool_call>{json}</tool_call>`` style of
Hermes, Qwen 2.5/3 and SmolLM3 templates::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``ToolCallStream`` is the one reader: text in (in any pieces), content and call deltas out (a call's first delta
carries its id and name, the later ones pieces of its arguments as the model writes them). A whole answer is read
by feeding it at once, so a streamed answer carries the same content and calls as the plain one.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from app.engine.sampling.json_schemas import closed_objects, json_options

PARSERS = ("hermes",)
ARGUMENT_KEYS = ("arguments", "parameters")  # the key of a call's arguments (Hermes writes "arguments")
_WHITESPACE = " \t\n\r"
# the longest prefix of a JSON string's inside made of whole characters and escapes (a cut escape waits)
_WHOLE_ESCAPES = re.compile(r'(?:[^\\]+|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')
_HIGH_SURROGATE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}$")


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class CallDelta:
    """A piece of a call as it is read: the first of a call has its ``id`` and ``name`` (and no arguments), the
    later ones the next piece of its ``arguments``. ``index`` counts the answer's calls from 0."""

    index: int
    arguments: str = ""
    name: str | None = None
    id: str | None = None

    def as_openai(self) -> dict:
        """OpenAI's ``tool_calls`` delta entry."""
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class HermesFormat:
    start, end = "<tool_call>", "</tool_call>"

    def grammar(self, tools: list[dict], name: str | None, parallel: bool, whitespace: str | None = None) -> str:
        """A Lark grammar (llguidance's, with ``%json``) for one call, or several when ``parallel``: of the named
        function, or of any of ``tools``; each call's arguments follow that function's JSON schema (read as
        structured outputs read schemas: ``json_schemas``, with ``whitespace`` as ``json_options`` takes it)."""
        chosen = [t for t in tools if name is None or t["name"] == name]
        branches = [
            {
                "type": "object",
                "properties": {"name": {"const": t["name"]}, "arguments": t.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in chosen
        ]
        schema = branches[0] if len(branches) == 1 else {"anyOf": branches}
        schema = {**closed_objects(schema), "x-guidance": json_options(whitespace)}
        calls = 'call ("\\n" call)*' if parallel and name is None else "call"
        return (
            f"start: {calls}\n"
            f"call: {json.dumps(self.start + chr(10))} body {json.dumps(chr(10) + self.end)}\n"
            f"body: %json {json.dumps(schema)}\n"
        )

    def prompt(self, messages: list[dict], tools: list[dict]) -> list[dict]:
        """The conversation for a chat template that does not render tools: the tools in the system message (each
        function's signature as JSON, and how to call one: this format's tags, which the reader and the forced-call
        grammar use), the assistant's earlier calls as its text, and tool results as user messages within
        ``<tool_response>`` tags, so that any template renders them."""
        signatures = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        block = (
            "You can call functions. Their signatures, as JSON, are within <tools></tools>:\n"
            f"<tools>\n{signatures}\n</tools>\n"
            f"To call a function, answer with a JSON object within {self.start}{self.end} tags (one pair per call):\n"
            f'{self.start}\n{{"name": <function-name>, "arguments": <arguments-json-object>}}\n{self.end}'
        )
        out: list[dict] = []
        if messages and messages[0]["role"] == "system":
            first, rest = messages[0], messages[1:]
            out.append({**first, "content": f"{first['content']}\n\n{block}" if first["content"] else block})
        else:
            out.append({"role": "system", "content": block})
            rest = messages
        for message in rest:
            if message["role"] == "assistant" and message.get("tool_calls"):
                calls = "\n".join(
                    f"{self.start}\n"
                    + json.dumps(
                        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False
                    )
                    + f"\n{self.end}"
                    for c in message["tool_calls"]
                )
                text = message.get("content") or ""
                out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
            elif message["role"] == "tool":
                out.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
            else:
                out.append(message)
        return out


def tool_format(name: str) -> HermesFormat:
    if name != "hermes":
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(PARSERS)}")
    return HermesFormat()


class CallBody:
    """The text after a call's opening tag, scanned as it comes, character by character: a JSON object whose
    top-level keys are followed (``name``, ``arguments``/``parameters``), strings and nesting tracked, until the
    closing tag (which counts only outside strings). Nothing is decided here; ``ToolCallStream`` asks."""

    def __init__(self, end_tag: str):
        self.end_tag = end_tag
        self.text = ""
        self.pos = 0  # scanned up to here
        self.stack: list[str] = []  # open objects and arrays
        self.in_string = self.escaped = False
        self.string_role: str | None = None  # "key" or "value" for a string at the top level, else None
        self.string_start = 0
        self.expect = "open"  # at the top level: open, key, colon, value, primitive, comma, after
        self.key: str | None = None
        self.value_start = 0
        self.name: str | None = None
        self.args_start: int | None = None  # where the arguments' value begins
        self.args_end: int | None = None  # and ends, once it has
        self.args_kind: str | None = None  # "string", "container" or "primitive"
        self.args_whole = False  # the arguments' value was read to its end
        self.closed = False  # the top-level object is closed
        self.bad = False  # the text is no JSON object (the closing tag is then looked for as it is)
        self.end: int | None = None  # where the closing tag begins, once it is in

    def feed(self, text: str) -> str | None:
        """Scan more text; returns what follows the closing tag once it is in (None while the call is open)."""
        self.text += text
        if self.bad:
            self._find_end()
        else:
            self._scan()
        if self.end is None:
            return None
        return self.text[self.end + len(self.end_tag) :]

    def _find_end(self) -> None:
        at = self.text.find(self.end_tag, self.pos)
        if at >= 0:
            self.end = self.pos = at
        else:
            self.pos = len(self.text) - partial_suffix(self.text, self.end_tag)

    def _fail(self, at: int) -> None:
        self.bad = True
        if self.args_start is not None and self.args_end is None:
            self.args_end = at  # arguments that break off end where they broke
        self.pos = at
        self._find_end()

    def _scan(self) -> None:
        text, i = self.text, self.pos
        while i < len(text):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.string_role == "key":
                        self.key = _loads(text[self.string_start : i + 1])
                        self.expect = "colon"
                    elif self.string_role == "value":
                        self._value_done(i + 1)
                i += 1
                continue
            if c == "<":  # outside strings: the closing tag, or what may still become it, or no JSON
                if text.startswith(self.end_tag, i):
                    if self.expect == "primitive":
                        self._value_done(i)
                    self.end = self.pos = i
                    return
                if self.end_tag.startswith(text[i:]):
                    break
                self._fail(i)
                return
            if c in _WHITESPACE:
                if self.expect == "primitive":
                    self._value_done(i)
                i += 1
                continue
            if len(self.stack) > 1:  # inside a top-level value: only nesting and strings matter
                if c in "{[":
                    self.stack.append(c)
                elif c in "}]":
                    self.stack.pop()
                    if len(self.stack) == 1:
                        self._value_done(i + 1)
                elif c == '"':
                    self.in_string, self.string_role = True, None
                i += 1
                continue
            if not self._top_level(c, i):
                self._fail(i)
                return
            i += 1
        self.pos = i

    def _top_level(self, c: str, i: int) -> bool:
        """One character outside strings at the top level; False when it breaks the object."""
        expect = self.expect
        if expect == "primitive":
            if c not in ",}":
                return True
            self._value_done(i)
            expect = self.expect
        if expect == "open":
            if c != "{":
                return False
            self.stack.append(c)
            self.expect = "key"
        elif expect == "key" and c == '"':
            self.in_string, self.string_role, self.string_start = True, "key", i
        elif expect == "colon" and c == ":":
            self.expect = "value"
        elif expect == "value":
            self.value_start = i
            kind = "string" if c == '"' else "container" if c in "{[" else "primitive"
            if self.key in ARGUMENT_KEYS and self.args_start is None:
                self.args_start, self.args_kind = i, kind
            if kind == "string":
                self.in_string, self.string_role, self.string_start = True, "value", i
                self.expect = "string"
            elif kind == "container":
                self.stack.append(c)
                self.expect = "container"
            else:
                self.expect = "primitive"
        elif expect == "comma" and c == ",":
            self.expect = "key"
        elif expect in ("key", "comma") and c == "}":  # (an empty object, or the last value's end)
            self.stack.pop()
            self.closed, self.expect = True, "after"
        else:
            return False
        return True

    def _value_done(self, end: int) -> None:
        value = self.text[self.value_start : end]
        if self.key == "name" and self.name is None:
            name = _loads(value)
            self.name = name if isinstance(name, str) else None
        if self.value_start == self.args_start:
            self.args_end, self.args_whole = end, True
        self.expect = "comma"

    def arguments(self, final: bool) -> str:
        """The call's arguments as far as they are read: the value's text as the model wrote it (a JSON text
        given as a string is read out of it); ``final``: the call has ended, whatever was written counts."""
        if self.args_start is None:
            return "{}" if self.closed else ""
        end = self.args_end if self.args_end is not None else self.pos
        raw = self.text[self.args_start : end]
        if self.args_kind == "primitive":
            return raw.rstrip() if final or self.args_end is not None else ""
        if self.args_kind != "string":
            return raw
        inside = raw[1:-1] if self.args_whole else raw[1:]
        whole = _WHOLE_ESCAPES.match(inside).group()
        if len(whole) < len(inside) or not self.args_whole:
            whole = _HIGH_SURROGATE.sub("", whole)  # its low half may be next
        try:
            return json.loads('"' + whole + '"', strict=False)
        except ValueError:
            return ""


def _loads(text: str):
    try:
        return json.loads(text, strict=False)
    except ValueError:
        return None


class ToolCallStream:
    """Reads one choice's text as it comes: ``feed(text)`` and ``finish()`` return (content, call deltas) released
    so far; ``calls`` holds the calls read so far (their arguments as far as they are read).

    Content outside calls is released as soon as it cannot be the start of the opening tag; leading and trailing
    whitespace of the whole content is dropped (whitespace between calls only where content follows), so the
    pieces join to what ``read_all`` gives. A call's text is held until it is known to be a call: its body is a
    JSON object whose string ``name`` is read and whose ``arguments`` have begun (or that closed without them:
    ``"{}"``). From then on it is a call: its arguments go out as they come, and it ends at the closing tag or at
    the end of the answer, whole or not. A body that never gets there (no JSON object, no name) stays content,
    tags included."""

    def __init__(self, fmt: HermesFormat):
        self.fmt = fmt
        self.buffer = ""  # content not yet released (what may be the start of an opening tag)
        self.body: CallBody | None = None  # the call being read
        self.call: ToolCall | None = None  # the call of ``body``, once it is known to be one
        self.calls: list[ToolCall] = []
        self.started = False  # content has begun (leading whitespace is dropped before)
        self.pending_space = ""  # whitespace held until content follows it

    def _content(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        stripped = text.rstrip()
        out = self.pending_space + stripped if stripped else ""
        self.pending_space = (self.pending_space if not stripped else "") + text[len(stripped) :]
        return out

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        content, deltas = "", []
        start = self.fmt.start
        while True:
            if self.body is None:
                self.buffer += text
                at = self.buffer.find(start)
                if at < 0:
                    keep = partial_suffix(self.buffer, start)
                    content += self._content(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                content += self._content(self.buffer[:at])
                text, self.buffer = self.buffer[at + len(start) :], ""
                self.body = CallBody(self.fmt.end)
            rest = self.body.feed(text)
            deltas += self._advance(final=rest is not None)
            if rest is None:
                break
            content += self._close()
            text = rest
        return content, deltas

    def finish(self) -> tuple[str, list[CallDelta]]:
        """The rest: a call left open at the end (a model that stops, or is cut, inside it) ends there."""
        deltas: list[CallDelta] = []
        content = ""
        if self.body is not None:
            deltas = self._advance(final=True)
            content = self._close()
        content += self._content(self.buffer)
        self.buffer = self.pending_space = ""
        return content, deltas

    def _advance(self, final: bool) -> list[CallDelta]:
        """The deltas of the open call since the last: its first once it is known to be a call, then more of its
        arguments."""
        body, out = self.body, []
        assert body is not None
        if self.call is None:
            if body.name is None or (body.args_start is None and not body.closed):
                return []
            self.call = ToolCall(body.name, "")
            self.calls.append(self.call)
            out.append(CallDelta(len(self.calls) - 1, "", self.call.name, self.call.id))
        arguments = body.arguments(final)
        sent = self.call.arguments
        if len(arguments) > len(sent) and arguments.startswith(sent):
            self.call.arguments = arguments
            out.append(CallDelta(len(self.calls) - 1, arguments[len(sent) :]))
        return out

    def _close(self) -> str:
        """The open call has ended: the content it turns out to be when it was no call."""
        body, self.body, call, self.call = self.body, None, self.call, None
        assert body is not None
        if call is not None:
            return ""
        end = body.end if body.end is not None else len(body.text)
        closing = self.fmt.end if body.end is not None else ""
        return self._content(self.fmt.start + body.text[:end] + closing)


def read_all(fmt: HermesFormat, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer: its content (None when there is none) and its calls."""
    stream = ToolCallStream(fmt)
    content, _ = stream.feed(text)
    tail, _ = stream.finish()
    return (content + tail) or None, stream.calls


def partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
