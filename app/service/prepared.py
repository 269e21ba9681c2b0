"""What ``CompletionService.prepare`` hands to the worker (``PreparedRequest``: a validated request with its
prompts as token ids and its frozen ``SamplingParams``) and what ``complete`` hands back (``ServedResponse``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from app.engine.params import SamplingParams, Timings


@dataclass
class ServedResponse:
    body: dict
    timings: Timings


@dataclass
class PreparedRequest:
    """A validated request, ready for the worker: its prompts as token ids, its parameters with the server's
    limits applied, and what the answer is read for (tool calls, thoughts)."""

    chat: bool
    model: str
    params: SamplingParams
    prompts: list[list[int]]
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage so far on every chunk
    tools: bool = False  # chat with tools: answers are read for tool calls
    thinks: bool | None = None  # reasoning parser on: whether answers start inside the thoughts
    echoed: str | None = None  # chat echo: the text each answer starts with
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    timings: Timings = field(default_factory=Timings)
