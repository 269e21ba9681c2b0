"""``ResponsesService``: the Responses API on the chat path: ``create`` (a whole response), ``events`` (a stream of
Responses events), ``get``/``delete`` (the store of responses a later request may continue)."""

from __future__ import annotations

import contextlib
import itertools
import logging
from typing import Any, Iterator

from app.engine.errors import EngineError
from app.errors import APIError, ClientClosedError, InternalServerError, NotFoundError, as_api_error
from app.protocol import ChatCompletionRequest
from app.response_store import ResponseStore
from app.responses.builder import ResponseBuilder
from app.responses.request import ResponsesRequest
from app.responses.stream_events import StreamState
from app.responses.to_chat import chat_request, responses_params

log = logging.getLogger("saker.responses")


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
        return chat_request(request, body, history)

    # -- whole responses -------------------------------------------------------------------------------------
    def create(self, request: ResponsesRequest, body: dict, alive=None) -> tuple[dict, Any, list[str]]:
        """(the response object, the timings, the tool types left out)."""
        chat, conversation, ignored = self.to_chat(request, body)
        with responses_params():
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
        with responses_params():
            prepared = self.completions.prepare(chat)
        return StreamState(request, prepared, conversation), ignored

    def events(self, state: StreamState, alive=None) -> Iterator[dict]:
        """Responses events of a stream, each with its ``type`` and a growing ``sequence_number``; a failure
        after the start is a ``response.failed`` event."""
        prepared, builder = state.prepared, state.builder
        chunks = self.completions.stream(prepared, alive=alive)
        finish, usage, text = None, None, []
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
                        for entry in delta.get("tool_calls") or []:
                            yield from state.call_delta(entry)
                        if choice.get("finish_reason"):
                            finish = state.finish = choice["finish_reason"]
                calls = state.calls
                if not calls and not state.message_open and not text:
                    yield from state.text_delta("", [])  # an empty answer is still a message
                yield from state.close_reasoning()
                yield from state.close_message()
                yield from state.close_call()
                prompt_tokens = (usage or {}).get("prompt_tokens", sum(len(ids) for ids in prepared.prompts))
                output_tokens = (usage or {}).get("completion_tokens", prepared.timings.generated_tokens)
                thoughts = state.reasoning["content"][0]["text"] if state.reasoning else None
                response = builder.finish(
                    finish, prompt_tokens, output_tokens, prepared.timings.cached_tokens, self._tokens(thoughts)
                )
                said = {"role": "assistant", "content": "".join(text) or None}
                if calls:
                    said["tool_calls"] = calls
                if state.request.store is not False:
                    self.store.put(response, state.conversation + [said])
                kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
                yield state.event(kind, response=response)
            except ClientClosedError:
                raise  # nobody to tell: the API layer logs how far it got
            except (APIError, EngineError) as err:
                yield state.event("response.failed", response=builder.failed(as_api_error(err)))
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
