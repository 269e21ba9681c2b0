"""The bad-input corpus, part one: request bodies (wrong types and huge numbers in every field, broken JSON, odd
strings, sizes, logit_bias keys, response formats, chat messages and tools, the tokenizer routes)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tooling.reliability.wire import build


@dataclass
class Case:
    name: str
    group: str
    data: bytes | list[bytes]
    shut: bool = False
    may_close: bool = False  # an incomplete request: the server may close without answering
    timeout: float = 120.0
    pause: float = 0.0
    allowed: tuple[int, ...] = ()  # statuses >= 500 that are this case's correct answer (RFC 9112 501)

    def preview(self) -> str:
        raw = self.data if isinstance(self.data, bytes) else b"".join(self.data)
        return raw[:240].decode("latin-1") + (f"... ({len(raw)} bytes)" if len(raw) > 240 else "")


COMPLETION_FIELDS = [
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "seed",
    "user",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "response_format",
    "structured_outputs",
    "allowed_token_ids",
    "logprobs_mode",
    "engine",
    "suffix",
    "logprobs",
    "echo",
    "best_of",
]
CHAT_FIELDS = [
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "add_generation_prompt",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "temperature",
    "n",
    "stream",
    "stop",
    "logit_bias",
    "response_format",
    "seed",
]
HUGE = 10**30


def wrong_values(quick: bool) -> list[Any]:
    if quick:
        return ["x", 1.5, -1, HUGE, True, {}, [[[[]]]]]
    return [
        "x",
        "",
        "\ud800",
        1.5,
        -1,
        0,
        2**63,
        HUGE,
        -HUGE,
        1e308,
        -1e308,
        True,
        False,
        None,
        [],
        [1],
        ["x"],
        {},
        {"a": 1},
        [[[[]]]],
    ]


def body_cases(model: str, quick: bool = False, context: int = 2048) -> list[Case]:
    """Malformed and hostile request bodies (each a Case of raw bytes). A body is sent with Connection: close."""
    cases: list[Case] = []
    good = {"model": model, "prompt": "Hello", "max_tokens": 2}
    chat = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
    ct = {"Content-Type": "application/json"}

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj).encode()  # ensure_ascii: lone surrogates travel as \\ud800 escapes

    def post(
        name: str, group: str, body: bytes, path: str = "/v1/completions", headers: dict | None = None, **kw
    ) -> None:
        cases.append(Case(name, group, build("POST", path, body, {**ct, **(headers or {})}), **kw))

    # -- wrong types and huge numbers in every field ------------------------------------------------------
    for base, fields, path in (
        (good, COMPLETION_FIELDS, "/v1/completions"),
        (chat, CHAT_FIELDS, "/v1/chat/completions"),
    ):
        for name in fields:
            for value in wrong_values(quick):
                if name in ("max_tokens", "max_completion_tokens") and value is None:
                    continue  # legal: runs to the context (long, not hostile)
                body = {**base, name: value}
                post(f"{path.rsplit('/', 1)[1]}.{name}={json.dumps(value)[:20]}", "wrong types", dumps(body), path)

    # -- JSON itself --------------------------------------------------------------------------------------
    raw_bodies = {
        "truncated": b'{"prompt": "hi", ',
        "single-quotes": b"{'prompt': 'hi'}",
        "trailing-comma": b'{"prompt": "hi",}',
        "form": b"prompt=hi",
        "two-objects": b'{"prompt": "hi"} {"prompt": "again"}',
        "bad-utf8": b'\xff\xfe{"prompt": "hi"}',
        "utf8-in-string-invalid": b'{"prompt": "\xff\xfe\xfd"}',
        "overlong-utf8": b'{"prompt": "\xc0\xaf"}',
        "raw-surrogate-bytes": b'{"prompt": "\xed\xa0\x80"}',
        "bom": b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 2}',
        "utf16": '{"prompt": "hi", "max_tokens": 2}'.encode("utf-16"),
        "empty": b"",
        "spaces": b"   ",
        "null": b"null",
        "list": b"[1, 2]",
        "number": b"5",
        "string": b'"prompt"',
        "true": b"true",
        "NaN": b'{"prompt": "hi", "temperature": NaN}',
        "Infinity": b'{"prompt": "hi", "top_p": Infinity}',
        "-Infinity": b'{"prompt": "hi", "temperature": -Infinity}',
        "1e400": b'{"prompt": "hi", "temperature": 1e400}',
        "max_tokens-1e400": b'{"prompt": "hi", "max_tokens": 1e400}',
        "5000-digit-int": b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
        "5000-digit-seed": b'{"prompt": "hi", "max_tokens": 2, "seed": -' + b"9" * 5000 + b"}",
        "deep-list-1000": b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}",
        "deep-list-100000": b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}",
        "deep-object-50000": b'{"prompt": "hi", "user": ' + b'{"a":' * 50000 + b"1" + b"}" * 50000 + b"}",
        "unclosed-deep": b'{"prompt": ' + b"[" * 100000,
        "schema-2000-deep": b'{"prompt": "hi", "max_tokens": 2, "response_format": {"type": "json_schema", '
        b'"json_schema": {"name": "x", "schema": '
        + b'{"type": "object", "properties": {"a": ' * 2000
        + b'{"type": "string"}'
        + b'}, "required": ["a"]}' * 2000
        + b"}}}",
        "structured-2000-deep": b'{"prompt": "hi", "max_tokens": 2, "structured_outputs": {"json": '
        + b'{"type": "array", "items": ' * 2000
        + b'{"type": "string"}'
        + b"}" * 2000
        + b"}}",
        "nul-in-json": b'{"prompt": "hi\x00"}',
        "control-chars": b'{"prompt": "a\x01\x02\x1f"}',
        "duplicate-keys": b"{" + b'"prompt": "a", ' * 20000 + b'"max_tokens": 2}',
        "many-unknown-keys": dumps({**good, **{f"k{i}": i for i in range(20000)}}),
        "escaped-nul": dumps({**good, "prompt": "a\u0000b"}),
    }
    if quick:
        for name in ("deep-object-50000", "duplicate-keys", "many-unknown-keys", "5000-digit-seed"):
            raw_bodies.pop(name)
    for name, body in raw_bodies.items():
        post(f"json.{name}", "JSON", body)

    # -- strings: surrogates, odd Unicode ------------------------------------------------------------------
    texts = {
        "lone-high-surrogate": "a\ud800b",
        "lone-low-surrogate": "\udfff",
        "surrogate-pair-escaped": "\ud83d\ude00",
        "reversed-pair": "\ude00\ud83d",
        "nul": "\u0000",
        "bidi": "\u202e\u2066abc",
        "noncharacter": "\uffff\ufdd0",
        "emoji-zwj": "👩‍👩‍👧‍👦" * 50,
        "combining": "a" + "\u0301" * 2000,
    }
    for name, text in texts.items():
        post(f"text.prompt.{name}", "strings", dumps({**good, "prompt": text}))
        post(
            f"text.chat.{name}",
            "strings",
            dumps({**chat, "messages": [{"role": "user", "content": text}]}),
            "/v1/chat/completions",
        )
        if not quick:
            post(f"text.stop.{name}", "strings", dumps({**good, "stop": [text]}))
            post(f"text.model.{name}", "strings", dumps({**good, "model": text}))
            post(f"text.logit_bias-key.{name}", "strings", dumps({**good, "logit_bias": {text: 1}}))
            post(f"text.user.{name}", "strings", dumps({**good, "user": text}))
    post("text.tokenize.lone-surrogate", "strings", dumps({"prompt": "\ud800"}), "/tokenize")
    post(
        "text.tokenize.messages-surrogate",
        "strings",
        dumps({"messages": [{"role": "user", "content": "\udc00"}]}),
        "/tokenize",
    )

    # -- huge numbers and sizes ----------------------------------------------------------------------------
    sizes = {
        "max_tokens-2**63": {**good, "max_tokens": 2**63},
        "n-huge": {**good, "n": HUGE},
        "best_of-huge": {**good, "best_of": HUGE, "n": 1},
        "top_k-huge": {**good, "top_k": HUGE},
        "top_k-2**31": {**good, "top_k": 2**31},
        "top_k-2**63": {**good, "top_k": 2**63},
        "seed-2**64": {**good, "seed": 2**64},
        "logprobs-huge": {**good, "logprobs": HUGE},
        "min_tokens-huge": {**good, "min_tokens": HUGE},
        "repetition_penalty-1e308": {**good, "repetition_penalty": 1e308},
        "temperature-5e-324": {**good, "temperature": 5e-324},
        "top_p-5e-324": {**good, "top_p": 5e-324},
        "min_p-1": {**good, "min_p": 1},
        "prompt-ids-huge": {**good, "prompt": [HUGE]},
        "prompt-ids-2**63": {**good, "prompt": [2**63]},
        "stop_token_ids-huge": {**good, "stop_token_ids": [HUGE]},
        "allowed_token_ids-huge": {**good, "allowed_token_ids": [HUGE]},
        "max_tokens-context": {**good, "max_tokens": context},
        "prompt-over-context-ids": {**good, "prompt": [1] * (context + 1)},
        "prompt-3.5MB-text": {**good, "prompt": "hello " * 600_000},
        "prompt-many-short": {**good, "prompt": ["a"] * 64, "max_tokens": 1},
        "stop-100k-chars": {**good, "stop": ["x" * 100_000]},
        "logit_bias-300-keys": {**good, "logit_bias": {str(i): 1 for i in range(1, 300)}},
        "logit_bias-value-1e308": {**good, "logit_bias": {"1": 1e308}},
        "chat-top_logprobs-huge": {**chat, "logprobs": True, "top_logprobs": HUGE},
        "chat-10000-messages": {**chat, "messages": [{"role": "user", "content": "a"}] * 10000},
        "chat-5000-parts": {**chat, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 5000}]},
    }
    if quick:
        sizes.pop("prompt-3.5MB-text")
    for name, body in sizes.items():
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        post(f"size.{name}", "huge numbers and sizes", dumps(body), path, timeout=600)
    post("size.over-body-limit", "huge numbers and sizes", dumps({**good, "prompt": "x" * (5 * 2**20)}))

    # -- logit_bias keys -----------------------------------------------------------------------------------
    for key in [
        "abc",
        "1.5",
        " 1",
        "1 ",
        "\u00b2",
        "\u0661",
        "1_0",
        "0x10",
        "+1",
        "-1",
        "",
        "7" * 5000,
        "99999999999999999999",
        "1e3",
        "٣",
        "１",
    ]:
        post(f"logit_bias.key={key[:12]!r}", "logit_bias", dumps({**good, "logit_bias": {key: 1}}))
    for value in ["x", None, True, [1], {"a": 1}, 101, -101]:
        post(f"logit_bias.value={json.dumps(value)}", "logit_bias", dumps({**good, "logit_bias": {"1": value}}))

    # -- response_format / structured_outputs ---------------------------------------------------------------
    formats = [
        {"type": "sound"},
        "json",
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": "x"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
        {"type": "json_schema", "json_schema": {"name": "a b", "schema": {"type": "object"}}},
        {"type": "json_schema", "json_schema": {"name": "x" * 1000, "schema": {"type": "object"}}},
        {"type": "json_object", "schema": 123},
        {"type": "json_object", "schema": {"type": "hiccup"}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/nope"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}},
        {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
        },
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(a+)+$"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(" * 5000}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "minItems": 10**9}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "minLength": HUGE}}},
        {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}},
        },
        {"type": "json_schema", "json_schema": {"name": "x", "schema": _deep_schema(150)}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": []}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": False}},
    ]
    for i, fmt in enumerate(formats):
        post(f"response_format.{i}:{json.dumps(fmt)[:40]}", "response_format", dumps({**good, "response_format": fmt}))
        if not quick:
            post(
                f"response_format.chat.{i}",
                "response_format",
                dumps({**chat, "response_format": fmt}),
                "/v1/chat/completions",
            )
    structured = [
        {"regex": "a", "choice": ["a"]},
        {},
        {"regex": "a(b"},
        {"choice": []},
        {"choice": ["a", ""]},
        {"json": "{oops"},
        {"grammar": "start: undefined_rule"},
        {"structural_tag": "{}"},
        {"regex": "(" * 10000},
        {"regex": "(a|aa)*" * 200},
        {"regex": "a{1000000000}"},
        {"grammar": "start: " + " ".join(f"r{i}" for i in range(2000))},
        {"json": _deep_schema(150)},
        {"choice": ["x" * 100] * 5000},
        {"regex": 5},
        {"json": 5},
        {"json_object": "yes"},
        {"unknown": 1},
    ]
    for i, so in enumerate(structured):
        post(
            f"structured_outputs.{i}:{json.dumps(so)[:40]}",
            "structured_outputs",
            dumps({**good, "structured_outputs": so}),
            timeout=300,
        )
    post(
        "structured_outputs.stream",
        "structured_outputs",
        dumps({**good, "stream": True, "structured_outputs": {"regex": "a(b"}}),
    )

    # -- chat: messages and tools -------------------------------------------------------------------------
    fn = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    chats = {
        "messages-empty": {"messages": []},
        "messages-string": {"messages": "hi"},
        "role-unknown": {"messages": [{"role": "robot", "content": "x"}]},
        "role-missing": {"messages": [{"content": "x"}]},
        "content-missing": {"messages": [{"role": "user"}]},
        "content-number": {"messages": [{"role": "user", "content": 5}]},
        "content-image": {
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
        },
        "content-part-no-text": {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "content-part-unknown": {"messages": [{"role": "user", "content": [{"type": "sound", "data": "x"}]}]},
        "tool-message-no-id": {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]},
        "assistant-bad-tool_calls": {
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "tool_calls": [{"id": 1, "function": 5}]},
            ]
        },
        "assistant-args-not-json": {
            "messages": [
                {"role": "user", "content": "x"},
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}],
                },
            ]
        },
        "tools-string": {"tools": "f"},
        "tools-list-of-numbers": {"tools": [1]},
        "tools-no-function": {"tools": [{"type": "function"}]},
        "tools-empty-function": {"tools": [{"type": "function", "function": {}}]},
        "tools-type-unknown": {"tools": [{"type": "retrieval", "function": {"name": "f"}}]},
        "tools-duplicate": {"tools": [fn, fn]},
        "tools-parameters-array": {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]
        },
        "tools-parameters-bad-schema": {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "hiccup"}}},
                    },
                }
            ],
            "tool_choice": "required",
        },
        "tool_choice-unknown-name": {"tools": [fn], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        "tool_choice-string": {"tools": [fn], "tool_choice": "sometimes"},
        "tool_choice-required-no-tools": {"tool_choice": "required"},
        "tool_choice-and-response_format": {
            "tools": [fn],
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        "tools-1000": {
            "tools": [
                {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
                for i in range(1000)
            ]
        },
        "top_logprobs-without-logprobs": {"top_logprobs": 3},
    }
    for name, change in chats.items():
        post(f"chat.{name}", "chat", dumps({**chat, **change}), "/v1/chat/completions", timeout=300)

    # -- tokenizer routes ----------------------------------------------------------------------------------
    for name, path, body in [
        ("tokenize-number", "/tokenize", {"prompt": 5}),
        ("tokenize-messages-string", "/tokenize", {"messages": "x"}),
        ("tokenize-both", "/tokenize", {"prompt": "a", "messages": []}),
        ("detokenize-negative", "/detokenize", {"tokens": [-1]}),
        ("detokenize-huge", "/detokenize", {"tokens": [HUGE]}),
        ("detokenize-string", "/detokenize", {"tokens": "x"}),
        ("detokenize-nested", "/detokenize", {"tokens": [[1]]}),
    ]:
        post(f"tokenizer.{name}", "tokenizer routes", dumps(body), path)

    return cases


def _deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema
