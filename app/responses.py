"""``POST /v1/responses`` (OpenAI's Responses API) on the chat path: a request becomes a chat completion request
(the same template, sampling, stops, limits, grammar and tool-call reader), its answer becomes a response object,
and a streamed answer becomes Responses events. No Flask and no torch here.

- ``ResponsesRequest``: the request's fields; ``to_chat`` turns it (and the stored conversation it continues) into
  a chat body, so that a string ``input`` gives, token for token, what chat gives for that user message.
- ``ResponsesService``: ``create`` (a whole response), ``events`` (a stream), ``get``/``delete`` (the store).
- Tool types a local server cannot run (``web_search``, ``file_search``, ...) are left out and named in the
  ``X-Saker-Ignored-Tools`` header; fields that do not apply to a local model are accepted and ignored.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import uuid
from typing import Annotated, Any, Iterator, Literal

from pydantic import AllowInfNan, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from app.errors import APIError, ClientClosedError, InternalServerError, InvalidRequestError, NotFoundError
from app.protocol import ChatCompletionRequest, parse_request
from app.response_store import ResponseStore

log = logging.getLogger("saker.responses")
Number = Annotated[StrictFloat, AllowInfNan(False)]
LOGPROBS_INCLUDE = "message.output_text.logprobs"
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


class ResponsesRequest(BaseModel):
    """POST /v1/responses. Unknown fields and fields that do not apply to a local model (``reasoning`` for a model
    without a reasoning parser, ``prompt_cache_key``, ``service_tier``, ``truncation``, ``client_metadata``,
    ``safety_identifier``, ``include`` values other than output logprobs) are ignored."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    input: StrictStr | list[Any]
    instructions: StrictStr | None = None
    tools: list[Any] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    include: list[StrictStr] | None = None
    text: dict | None = None
    stream: StrictBool | None = False
    store: StrictBool | None = True
    previous_response_id: StrictStr | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    truncation: StrictStr | None = None
    reasoning: dict | None = None

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])


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
def _responses_params():
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


def _echoed_tool(tool: Any) -> Any:
    """A tool as the response echoes it: function tools with ``strict`` and ``parameters`` (null when not sent)."""
    if isinstance(tool, dict) and tool.get("type") == "function":
        return {"strict": None, "parameters": None, **tool}
    return tool


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


class ResponsesService:
    def __init__(self, completions, store: ResponseStore):
        self.completions = completions  # the CompletionService (chat path)
        self.store = store

    # -- the request -----------------------------------------------------------------------------------------
    def to_chat(self, request: ResponsesRequest, body: dict) -> tuple[ChatCompletionRequest, list[dict], list[str]]:
        """The chat request this response is made by, the conversation's messages (instructions aside) and the
        tool types left out."""
        history: list[dict] = []
        if request.previous_response_id is not None:
            stored = self.store.get(request.previous_response_id)
            if stored is None:
                raise NotFoundError(
                    f"Previous response with id '{request.previous_response_id}' not found (it was "
                    "never stored, was deleted, or was evicted from this worker's store)",
                    param="previous_response_id",
                )
            history = stored.messages
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
        with _responses_params():
            return parse_request(ChatCompletionRequest, chat), conversation, ignored

    # -- whole responses -------------------------------------------------------------------------------------
    def create(self, request: ResponsesRequest, body: dict, alive=None) -> tuple[dict, Any, list[str]]:
        """(the response object, the timings, the tool types left out)."""
        chat, conversation, ignored = self.to_chat(request, body)
        with _responses_params():
            served = self.completions.complete(chat, alive=alive)
        choice = served.body["choices"][0]
        message = choice["message"]
        builder = ResponseBuilder(request, served.body["model"])
        if message.get("reasoning"):
            builder.add_reasoning(message["reasoning"])
        if message.get("content") or not message.get("tool_calls"):
            logprobs = (choice.get("logprobs") or {}).get("content")
            builder.add_message(message.get("content") or "", logprobs if request.wants_logprobs else None)
        for call in message.get("tool_calls") or []:
            builder.add_call(call)
        usage = served.body["usage"]
        response = builder.finish(
            choice["finish_reason"],
            usage["prompt_tokens"],
            usage["completion_tokens"],
            served.timings.cached_tokens,
            self._tokens(message.get("reasoning")),
        )
        self._keep(request, response, conversation, message)
        return response, served.timings, ignored

    def _keep(self, request: ResponsesRequest, response: dict, conversation: list[dict], message: dict) -> None:
        if request.store is not False:  # null means the default, which is to store
            said = {"role": "assistant", "content": message.get("content")}
            if message.get("tool_calls"):
                said["tool_calls"] = message["tool_calls"]
            self.store.put(response, conversation + [said])

    # -- streams ---------------------------------------------------------------------------------------------
    def prepare_stream(self, request: ResponsesRequest, body: dict):
        """Validate and prepare a streamed response before anything is sent (errors are HTTP errors then)."""
        chat, conversation, ignored = self.to_chat(request, body)
        with _responses_params():
            job = self.completions.prepare(chat)
        return StreamState(request, job, conversation), ignored

    def events(self, state: "StreamState", alive=None) -> Iterator[dict]:
        """Responses events of a stream, each with its ``type`` and a growing ``sequence_number``; a failure
        after the start is a ``response.failed`` event."""
        job, builder = state.job, state.builder
        chunks = self.completions.stream(job, alive=alive)
        finish, usage, text, calls = None, None, [], []
        with contextlib.closing(chunks):
            first = next(chunks, None)  # a full queue or an error before the first token: an HTTP error
            yield state.event("response.created", response=builder.snapshot("in_progress"))
            yield state.event("response.in_progress", response=builder.snapshot("in_progress"))
            try:
                for chunk in itertools.chain([first] if first is not None else [], chunks):
                    if chunk.get("usage") and not chunk["choices"]:
                        usage = chunk["usage"]
                        continue
                    for choice in chunk["choices"]:
                        delta = choice.get("delta") or {}
                        if delta.get("reasoning"):
                            yield from state.thought(delta["reasoning"])
                        if delta.get("content"):
                            logprobs = (choice.get("logprobs") or {}).get("content") or []
                            yield from state.text_delta(delta["content"], logprobs)
                            text.append(delta["content"])
                        for call in delta.get("tool_calls") or []:
                            yield from state.close_message()
                            yield from state.call(call)
                            calls.append(call)
                        if choice.get("finish_reason"):
                            finish = state.finish = choice["finish_reason"]
                if not calls and not state.message_open and not text:
                    yield from state.text_delta("", [])  # an empty answer is still a message
                yield from state.close_reasoning()
                yield from state.close_message()
                prompt_tokens = (usage or {}).get("prompt_tokens", sum(len(ids) for ids in job.prompts))
                output_tokens = (usage or {}).get("completion_tokens", job.timings.generated_tokens)
                thoughts = state.reasoning["content"][0]["text"] if state.reasoning else None
                response = builder.finish(
                    finish, prompt_tokens, output_tokens, job.timings.cached_tokens, self._tokens(thoughts)
                )
                said = {"role": "assistant", "content": "".join(text) or None}
                if calls:
                    said["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
                if state.request.store is not False:
                    self.store.put(response, state.conversation + [said])
                kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
                yield state.event(kind, response=response)
            except ClientClosedError:
                raise  # nobody to tell: the API layer logs how far it got
            except APIError as err:
                yield state.event("response.failed", response=builder.failed(err))
            except Exception:
                log.exception("response %s failed while streaming", builder.id)
                yield state.event(
                    "response.failed",
                    response=builder.failed(
                        InternalServerError("The server had an error while streaming this response")
                    ),
                )

    def _tokens(self, text: str | None) -> int:
        """Tokens of a reasoning parser's thoughts (re-encoded: the answer's tokens are not split by tag)."""
        if not text:
            return 0
        return len(self.completions.worker.tokenizer(text, add_special_tokens=False)["input_ids"])

    # -- the store -------------------------------------------------------------------------------------------
    def get(self, response_id: str) -> dict:
        stored = self.store.get(response_id)
        if stored is None:
            raise NotFoundError(f"Response with id '{response_id}' not found", param="response_id")
        return stored.response

    def delete(self, response_id: str) -> dict:
        if not self.store.delete(response_id):
            raise NotFoundError(f"Response with id '{response_id}' not found", param="response_id")
        return {"id": response_id, "object": "response.deleted", "deleted": True}


class ResponseBuilder:
    """The response object: its output items as they come, then its status and usage."""

    def __init__(self, request: ResponsesRequest, model: str):
        self.request, self.model = request, model
        self.id = new_id("resp_")
        self.created = int(time.time())
        self.output: list[dict] = []

    def add_message(self, text: str, logprobs: list | None) -> dict:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
        item = {"type": "message", "id": new_id("msg_"), "status": "completed", "role": "assistant", "content": [part]}
        self.output.append(item)
        return item

    def add_reasoning(self, text: str) -> dict:
        item = {
            "type": "reasoning",
            "id": new_id("rs_"),
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed",
        }
        self.output.append(item)
        return item

    def add_call(self, call: dict) -> dict:
        item = {
            "type": "function_call",
            "id": new_id("fc_"),
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"],
            "status": "completed",
        }
        self.output.append(item)
        return item

    def snapshot(self, status: str, output: list | None = None) -> dict:
        r = self.request
        fmt = (r.text or {}).get("format") or {"type": "text"}
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "model": self.model,
            "output": self.output if output is None else output,
            "parallel_tool_calls": r.parallel_tool_calls if r.parallel_tool_calls is not None else True,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": r.store is not False,
            "temperature": r.temperature if r.temperature is not None else 1.0,
            "text": {"format": fmt},
            "tool_choice": r.tool_choice or "auto",
            "tools": [_echoed_tool(t) for t in r.tools or []],
            "top_logprobs": r.top_logprobs or 0,
            "top_p": r.top_p if r.top_p is not None else 1.0,
            "truncation": "disabled",
            "metadata": r.metadata or {},
        }
        if getattr(r, "user", None) is not None:  # left out when unset (the schema has a string or nothing)
            out["user"] = r.user
        return out

    def finish(
        self, finish_reason: str | None, input_tokens: int, output_tokens: int, cached: int, reasoning_tokens: int = 0
    ) -> dict:
        response = self.snapshot("incomplete" if finish_reason == "length" else "completed")
        if finish_reason == "length":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
            for item in response["output"]:
                if item["type"] in ("message", "reasoning"):
                    item["status"] = "incomplete"
        response["usage"] = {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens,
        }
        return response

    def failed(self, err: APIError) -> dict:
        response = self.snapshot("failed")
        code = (
            "rate_limit_exceeded" if err.status == 429 else "invalid_prompt" if err.status == 400 else "server_error"
        )  # the codes the Responses schema has
        response["error"] = {"code": code, "message": err.message}
        return response


class StreamState:
    """A streamed response's progress: sequence numbers, the open message item, output indexes."""

    def __init__(self, request: ResponsesRequest, job, conversation: list[dict]):
        self.request, self.job, self.conversation = request, job, conversation
        self.builder = ResponseBuilder(request, job.model)
        self.sequence = 0
        self.message: dict | None = None  # the message item being written
        self.reasoning: dict | None = None  # the reasoning item (a reasoning parser's thoughts)
        self.finish: str | None = None  # the answer's finish_reason, once known
        self.logprobs: list = []

    @property
    def message_open(self) -> bool:
        return self.message is not None

    def event(self, kind: str, **fields) -> dict:
        out = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return out

    def thought(self, text: str) -> Iterator[dict]:
        """Thoughts (a reasoning parser): a ``reasoning`` item before the message, its text in deltas."""
        if self.reasoning is None:
            self.reasoning = self.builder.add_reasoning("")
            self.reasoning["status"] = "in_progress"
            index = len(self.builder.output) - 1
            yield self.event("response.output_item.added", output_index=index, item={**self.reasoning, "content": []})
        self.reasoning["content"][0]["text"] += text
        yield self.event(
            "response.reasoning_text.delta",
            item_id=self.reasoning["id"],
            output_index=self.builder.output.index(self.reasoning),
            content_index=0,
            delta=text,
        )

    def close_reasoning(self) -> Iterator[dict]:
        if self.reasoning is None or self.reasoning["status"] == "completed":
            return
        item = self.reasoning
        index = self.builder.output.index(item)
        yield self.event(
            "response.reasoning_text.done",
            item_id=item["id"],
            output_index=index,
            content_index=0,
            text=item["content"][0]["text"],
        )
        item["status"] = "incomplete" if self.finish == "length" else "completed"
        yield self.event("response.output_item.done", output_index=index, item=item)

    def text_delta(self, text: str, logprobs: list) -> Iterator[dict]:
        yield from self.close_reasoning()
        if self.message is None:
            self.message = self.builder.add_message("", [] if self.request.wants_logprobs else None)
            self.message["status"] = "in_progress"
            index = len(self.builder.output) - 1
            yield self.event("response.output_item.added", output_index=index, item={**self.message, "content": []})
            yield self.event(
                "response.content_part.added",
                item_id=self.message["id"],
                output_index=index,
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            )
        part = self.message["content"][0]
        part["text"] += text
        if self.request.wants_logprobs:
            part["logprobs"] += logprobs
        if text:
            yield self.event(
                "response.output_text.delta",
                item_id=self.message["id"],
                output_index=self.builder.output.index(self.message),
                content_index=0,
                delta=text,
                logprobs=logprobs if self.request.wants_logprobs else [],
            )

    def close_message(self) -> Iterator[dict]:
        if self.message is None:
            return
        item, self.message = self.message, None
        index = self.builder.output.index(item)
        part = item["content"][0]
        yield self.event(
            "response.output_text.done",
            item_id=item["id"],
            output_index=index,
            content_index=0,
            text=part["text"],
            logprobs=part.get("logprobs") or [],
        )
        yield self.event(
            "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
        )
        item["status"] = "incomplete" if self.finish == "length" else "completed"
        yield self.event("response.output_item.done", output_index=index, item=item)

    def call(self, call: dict) -> Iterator[dict]:
        yield from self.close_reasoning()
        item = self.builder.add_call(call)
        index = len(self.builder.output) - 1
        arguments = item["arguments"]
        yield self.event(
            "response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"}
        )
        yield self.event(
            "response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=arguments
        )
        yield self.event(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=index,
            name=item["name"],
            arguments=arguments,
        )
        yield self.event("response.output_item.done", output_index=index, item=item)
