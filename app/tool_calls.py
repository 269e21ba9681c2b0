"""Tool calls in a chat model's own format: the grammar that forces them (``tool_choice`` required or named) and
the parser that reads them out of the generated text (plain and streamed alike). No torch here.

The format is a setting (``SAKER_TOOL_CALL_PARSER``); ``hermes`` is the ``<tool_call>{json}</tool_call>`` style of
Hermes, Qwen 2.5/3 and SmolLM3 templates::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``ToolCallStream`` is the one reader: text in (in any pieces), content and finished calls out. A whole answer
is read by feeding it at once, so a streamed answer carries the same content and calls as the plain one.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from app.engine.json_schemas import JSON_OPTIONS, closed_objects

PARSERS = ("hermes",)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class HermesFormat:
    start, end = "<tool_call>", "</tool_call>"

    def grammar(self, tools: list[dict], name: str | None, parallel: bool) -> str:
        """A Lark grammar (llguidance's, with ``%json``) for one call, or several when ``parallel``: of the named
        function, or of any of ``tools``; each call's arguments follow that function's JSON schema (read as
        structured outputs read schemas: ``json_schemas``)."""
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
        schema = {**closed_objects(schema), "x-guidance": JSON_OPTIONS}
        calls = 'call ("\\n" call)*' if parallel and name is None else "call"
        return (
            f"start: {calls}\n"
            f"call: {json.dumps(self.start + chr(10))} body {json.dumps(chr(10) + self.end)}\n"
            f"body: %json {json.dumps(schema)}\n"
        )

    def read_call(self, body: str) -> ToolCall | None:
        """One call's text between the tags, or None when it is not a call (then it stays content)."""
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                json.loads(arguments)
            except ValueError:
                return None
        else:
            arguments = json.dumps(arguments, ensure_ascii=False)
        return ToolCall(value["name"], arguments)


def tool_format(name: str) -> HermesFormat:
    if name != "hermes":
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(PARSERS)}")
    return HermesFormat()


class ToolCallStream:
    """Reads one choice's text as it comes: ``feed(text)`` and ``finish()`` return (content, calls) released so
    far. Content outside calls is released as soon as it cannot be the start of a call tag; leading and
    trailing whitespace of the whole content is dropped (whitespace between calls only where content follows),
    so the pieces join to what ``read_all`` gives."""

    def __init__(self, fmt: HermesFormat):
        self.fmt = fmt
        self.buffer = ""
        self.in_call = False
        self.started = False  # content has begun (leading whitespace is dropped before)
        self.pending_space = ""  # whitespace held until content follows it
        self.calls = 0

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

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buffer += text
        content, calls = "", []
        start, end = self.fmt.start, self.fmt.end
        while True:
            if not self.in_call:
                at = self.buffer.find(start)
                if at < 0:
                    keep = partial_suffix(self.buffer, start)
                    content += self._content(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                content += self._content(self.buffer[:at])
                self.buffer = self.buffer[at:]
                self.in_call = True
            at = self.buffer.find(end)
            if at < 0:
                break
            raw = self.buffer[: at + len(end)]
            call = self.fmt.read_call(raw[len(start) : at])
            if call is None:
                content += self._content(raw)
            else:
                calls.append(call)
            self.buffer = self.buffer[at + len(end) :]
            self.in_call = False
        self.calls += len(calls)
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest: a call left open at the end (a model that stops before the closing tag) still counts when its
        body is a whole call."""
        rest, self.buffer = self.buffer, ""
        if self.in_call:
            call = self.fmt.read_call(rest[len(self.fmt.start) :])
            if call is not None:
                self.calls += 1
                return "", [call]
        text = self._content(rest)
        self.pending_space = ""
        return text, []


def read_all(fmt: HermesFormat, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer: its content (None when there is none) and its calls."""
    stream = ToolCallStream(fmt)
    content, calls = stream.feed(text)
    tail, more = stream.finish()
    return (content + tail) or None, calls + more


def partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
