"""Reasoning parsers: the thoughts of models that think in tags, apart from their answer. No torch here.

``SAKER_REASONING_PARSER=think`` reads ``<think>...</think>``, as Qwen3 and the DeepSeek-R1 distills write it: a
``<think>`` at the start of the answer opens the thoughts (leading whitespace aside), ``</think>`` closes them, and
what follows is the answer. Templates that open ``<think>`` in the prompt themselves (the R1 distills') start
the answer inside the thoughts: the prompt is checked for that (``starts_inside``). An answer without the tags
is all answer; thoughts never closed (max_tokens inside them) are all thoughts.

``ThinkStream`` is the one reader, for whole answers (fed at once) and streams alike.
"""

from __future__ import annotations

import re

from app.tool_calls import partial_suffix

PARSERS = ("none", "think")
START, END = "<think>", "</think>"
_OPENED = re.compile(r"<think>\s*$")


def starts_inside(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside an opened ``<think>`` (the answer starts with thoughts)."""
    return bool(_OPENED.search(prompt_text[-64:]))


class ThinkStream:
    """``feed(text)`` and ``finish()`` return (thoughts, answer) released so far. Leading whitespace of each is
    dropped; an answer's text that could still be the opening tag waits until it is ruled out."""

    def __init__(self, inside: bool = False):
        self.inside = inside
        self.thought = inside  # thoughts were opened (no second <think> is looked for after them)
        self.buffer = ""
        self.thinking_started = False  # leading whitespace of the thoughts is dropped until they start
        self.answer_started = False

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        thoughts, answer = "", ""
        while self.buffer:
            if self.inside:
                at = self.buffer.find(END)
                if at < 0:
                    keep = partial_suffix(self.buffer, END)
                    thoughts += self._thoughts(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                thoughts += self._thoughts(self.buffer[:at])
                self.buffer = self.buffer[at + len(END) :]
                self.inside = False
                continue
            if not self.thought and not self.answer_started:
                head = self.buffer.lstrip()
                if head.startswith(START):
                    self.buffer = head[len(START) :]
                    self.inside = self.thought = True
                    continue
                if START.startswith(head):  # blank so far, or a tag that may be coming
                    break
            answer += self._answer(self.buffer)
            self.buffer = ""
        return thoughts, answer

    def finish(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        if self.inside:
            return self._thoughts(rest), ""
        return "", self._answer(rest)

    def _thoughts(self, text: str) -> str:
        if not self.thinking_started:
            text = text.lstrip()
            self.thinking_started = bool(text)
        return text

    def _answer(self, text: str) -> str:
        if not self.answer_started:
            text = text.lstrip()
            self.answer_started = bool(text)
        return text
