"""How a chat choice's text is read: thoughts (a reasoning parser) and tool calls apart from the content. The
same reader serves whole answers and streams, so both say the same."""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.reasoning import ThinkStream
from app.tool_calls import CallDelta, ToolCall, ToolCallStream

if TYPE_CHECKING:
    from app.service.prepared import PreparedRequest


class AnswerReader:
    """One chat choice's text as the client sees it: thoughts (a reasoning parser), then content and tool calls
    (tools). The same reader serves whole answers (fed at once) and streams, so both say the same."""

    def __init__(self, think: ThinkStream | None, tools: ToolCallStream | None):
        self.think, self.tools = think, tools

    @property
    def calls(self) -> list[ToolCall]:
        """The calls read so far (the last one's arguments as far as they are read)."""
        return self.tools.calls if self.tools is not None else []

    def feed(self, text: str, final: bool) -> tuple[str, str, list[CallDelta]]:
        """(thoughts, content, call deltas) released by this piece of text; ``final``: it is the answer's last."""
        thoughts, content = self.think.feed(text) if self.think is not None else ("", text)
        if final and self.think is not None:
            more_thoughts, more_content = self.think.finish()
            thoughts, content = thoughts + more_thoughts, content + more_content
        deltas: list[CallDelta] = []
        if self.tools is not None:
            content, deltas = self.tools.feed(content)
            if final:
                tail, more = self.tools.finish()
                content, deltas = content + tail, deltas + more
        return thoughts, content, deltas


def reader_for(prepared: PreparedRequest, tool_format) -> AnswerReader | None:
    """What reads a chat choice's text: thoughts (reasoning parser) and tool calls apart from the content."""
    if not prepared.chat or (not prepared.tools and prepared.thinks is None):
        return None
    return AnswerReader(
        ThinkStream(prepared.thinks) if prepared.thinks is not None else None,
        ToolCallStream(tool_format) if prepared.tools else None,
    )


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish_reason: tool_calls when an answer that ended on its own made calls."""
    return "tool_calls" if reason == "stop" and called else reason
