"""Reading server-sent events: one reader for the chat client, the bench, the reliability run and the tests.

The source is anything that yields bytes or text in pieces of any size: a binary stream (``http.client``'s
response, ``io.BytesIO``: iterating them reads a line at a time, so each event is out as soon as its blank line
arrives), ``requests``' ``iter_content()``, a WSGI or Flask response body, a list of lines, or one whole string.
The WHATWG rules: lines end in CRLF, LF or CR (also when a CRLF is split between two pieces); ``data:`` lines
(one optional space after the colon) of one event are joined with newlines; ``event:`` names the event (its type
otherwise is ``message``); ``id:`` sets the last event id; comment lines (``:``) and ``retry:`` are skipped; an
event without data lines is not dispatched. An event cut off by the end of the stream is still delivered
(lenient: some servers forget the last blank line).

OpenAI-style streams end with ``data: [DONE]``: ``iter_data`` and ``iter_json`` stop there. Standard library
only.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

DONE = "[DONE]"
_LINE_END = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True)
class Event:
    data: str
    event: str = "message"
    id: str | None = None

    @property
    def done(self) -> bool:
        """The ``data: [DONE]`` that ends an OpenAI stream."""
        return self.data.strip() == DONE

    def json(self) -> Any:
        """The data as JSON (ValueError when it is not)."""
        return json.loads(self.data)


def iter_lines(source: Iterable[bytes | str] | bytes | str) -> Iterator[str]:
    """The lines of ``source`` without their ends, each as soon as its end has arrived (bytes are decoded as
    UTF-8, an invalid sequence as U+FFFD); a last line without an end comes out at the end of the source."""
    if isinstance(source, (bytes, str)):
        source = [source]
    elif hasattr(source, "readline"):
        source = _readlines(source)
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    buffer, after_cr = "", False
    for piece in source:
        text = decoder.decode(piece) if isinstance(piece, (bytes, bytearray)) else piece
        if not text:
            continue
        if after_cr and text.startswith("\n"):  # the LF of a CRLF whose CR ended the last piece
            text = text[1:]
        after_cr = text.endswith("\r")
        parts = _LINE_END.split(buffer + text)
        buffer = parts.pop()  # what follows the last line end ("" when the piece ended with one)
        yield from parts
    buffer += decoder.decode(b"", final=True)
    if buffer:
        yield buffer


def _readlines(stream) -> Iterator[bytes | str]:
    """A stream's lines through ``readline()``, which returns as soon as a line (or the stream) ends."""
    while line := stream.readline():
        yield line


def iter_events(source: Iterable[bytes | str] | bytes | str) -> Iterator[Event]:
    """The events of ``source``, each as soon as the blank line that ends it arrives."""
    data: list[str] = []
    name, last_id = "", None
    for line in iter_lines(source):
        if line == "":
            if data:
                yield Event("\n".join(data), name or "message", last_id)
            data, name = [], ""
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            data.append(value)
        elif field == "event":
            name = value
        elif field == "id" and "\0" not in value:
            last_id = value
    if data:
        yield Event("\n".join(data), name or "message", last_id)


def iter_data(source: Iterable[bytes | str] | bytes | str) -> Iterator[str]:
    """The data of each event up to ``[DONE]`` (which is not yielded)."""
    for event in iter_events(source):
        if event.done:
            return
        yield event.data


def iter_json(source: Iterable[bytes | str] | bytes | str) -> Iterator[Any]:
    """The data of each event up to ``[DONE]``, as JSON (ValueError on data that is not)."""
    for data in iter_data(source):
        yield json.loads(data)


@dataclass
class Stream:
    """A whole stream read at once: its events, the JSON chunks before ``[DONE]``, and whether ``[DONE]`` came
    (and came last)."""

    events: list[Event]
    chunks: list[Any]
    done: bool

    @property
    def errors(self) -> list[Any]:
        """The ``{"error": ...}`` chunks (an error after the stream began)."""
        return [c for c in self.chunks if isinstance(c, dict) and "error" in c]


def read_stream(source: Iterable[bytes | str] | bytes | str) -> Stream:
    """Every event of ``source``; ``chunks`` holds the JSON of the data events before ``[DONE]`` (ValueError on
    one that is not JSON), ``done`` is true when ``[DONE]`` was the last event."""
    events = list(iter_events(source))
    end = next((i for i, e in enumerate(events) if e.done), len(events))
    chunks = [e.json() for e in events[:end]]
    return Stream(events, chunks, done=end == len(events) - 1)
