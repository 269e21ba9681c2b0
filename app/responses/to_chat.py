"""A Responses request as a chat completion request: ``input`` items as chat messages (function calls and their
outputs included), function tools and ``tool_choice`` in chat's shape, ``text.format`` as ``response_format``, and
chat's errors renamed to the Responses request's fields. A string ``input`` gives, token for token, what chat
gives for that user message."""

from __future__ import annotations

import contextlib
from typing import Any

from app.errors import InvalidRequestError
from app.protocol import ChatCompletionRequest, parse_request
from app.responses.request import ResponsesRequest

# chat fields a Responses request may carry as they are (vLLM's sampling extensions and OpenAI's own)
PASSED_TO_CHAT = (
    "temperature",
    "top_p",
    "seed",
    "user",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "structured_outputs",
    "logprobs_mode",
    "parallel_tool_calls",
)
# chat's names for fields, as the Responses request calls them (for errors)
PARAM_NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
}


def chat_request(
    request: ResponsesRequest, body: dict, history: list[dict]
) -> tuple[ChatCompletionRequest, list[dict], list[str]]:
    """The chat request this response is made by, the conversation's messages (instructions aside) and the
    tool types left out. ``history``: the messages of the stored conversation it continues."""
    conversation = history + input_messages(request.input, call_ids(history))
    tools, ignored = chat_tools(request.tools)
    chat: dict[str, Any] = {
        "model": request.model,
        "messages": ([{"role": "system", "content": request.instructions}] if request.instructions else [])
        + conversation,
    }
    for key in PASSED_TO_CHAT:
        if body.get(key) is not None:
            chat[key] = body[key]
    if request.max_output_tokens is not None:
        chat["max_completion_tokens"] = request.max_output_tokens
    if tools:
        chat["tools"] = tools
        if request.tool_choice is not None:
            chat["tool_choice"] = chat_tool_choice(request.tool_choice)
    elif request.tool_choice not in (None, "auto", "none"):
        raise InvalidRequestError(
            "tool_choice names a tool, but the request has no function tools", param="tool_choice"
        )
    fmt = chat_format(request.text)
    if fmt is not None:
        chat["response_format"] = fmt
    if request.wants_logprobs:
        chat["logprobs"] = True
        chat["top_logprobs"] = request.top_logprobs or 0
    if request.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    with responses_params():
        return parse_request(ChatCompletionRequest, chat), conversation, ignored


def _text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or parts of type input_text / output_text / text / refusal."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content must be a string or a list of content parts", param="input")
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            if not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{where}: a {kind} part needs its text", param="input")
            out.append(part["text"])
        elif kind == "refusal":
            out.append(str(part.get("refusal", "")))
        elif kind in ("input_image", "input_file", "input_audio"):
            raise InvalidRequestError(
                f"{where}: {kind} parts are not supported: this server serves a text model", param="input"
            )
        else:
            raise InvalidRequestError(f"{where}: unknown content part type {kind!r}", param="input")
    return "".join(out)


def input_messages(items: str | list, known_calls: set[str]) -> list[dict]:
    """The request's ``input`` as chat messages. ``known_calls``: call ids of earlier function calls (of the
    conversation it continues); a ``function_call_output`` must answer one of them or one in this input."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    calls = set(known_calls)
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where} must be an object (an input item)", param="input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequestError(
                    f"{where}.role must be user, assistant, system or developer, not {role!r}", param="input"
                )
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
            if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(arguments, str)):
                raise InvalidRequestError(
                    f"{where}: a function_call needs call_id, name and arguments (a JSON string)", param="input"
                )
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            calls.add(call_id)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if call_id not in calls:
                raise InvalidRequestError(
                    f"{where}: function_call_output answers call_id {call_id!r}, which no "
                    "function_call of this conversation has",
                    param="input",
                )
            text = output if isinstance(output, str) else _text_of(output, where)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue  # thoughts of an earlier turn: not part of the prompt
        else:
            raise InvalidRequestError(
                f"{where}: unknown input item type {kind!r}; known: message, function_call, "
                "function_call_output, reasoning",
                param="input",
            )
    return messages


def call_ids(messages: list[dict]) -> set[str]:
    return {call["id"] for m in messages for call in m.get("tool_calls") or []}


def chat_tools(tools: list | None) -> tuple[list[dict] | None, list[str]]:
    """Function tools in chat's shape, and the types of the tools left out (a local server cannot run them)."""
    out, ignored = [], []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise InvalidRequestError(f"tools[{i}] must be an object with a type", param="tools")
        if tool["type"] != "function":
            ignored.append(tool["type"])
            continue
        function = {
            key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None
        }
        out.append({"type": "function", "function": function})
    return out or None, ignored


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise InvalidRequestError(
        f"tool_choice of type {choice.get('type')!r} is not supported; use auto, none, "
        'required or {"type": "function", "name": ...}',
        param="tool_choice",
    )


def chat_format(text: dict | None) -> dict | None:
    """``text.format`` as chat's ``response_format``."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise InvalidRequestError(
            f"text.format type must be one of text, json_object, json_schema, not {kind!r}", param="text"
        )
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    return {
        "type": "json_schema",
        "json_schema": {key: fmt[key] for key in ("name", "description", "schema", "strict") if key in fmt},
    }


@contextlib.contextmanager
def responses_params():
    """Errors of the chat path name the Responses request's fields (``max_tokens`` -> ``max_output_tokens``...)."""
    try:
        yield
    except InvalidRequestError as exc:
        param = PARAM_NAMES.get(exc.param, exc.param)
        if param != exc.param and exc.param:
            exc.message = exc.message.replace(exc.param, param)
            exc.args = (exc.message,)
        exc.param = param
        raise
