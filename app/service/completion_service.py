"""``CompletionService``: what the routes call, between the HTTP layer and the engine's worker. It resolves the
model name, turns prompts and messages into token ids, applies the limits and compiles a request's constraint before
anything is generated (``prepare``), then has the worker answer it whole (``complete``) or as a stream
(``stream``). No Flask and no torch here: the worker does the model work, ``app/api.py`` does HTTP."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Iterator

from app.engine.params import Constraint
from app.engine.errors import ConstraintError
from app.errors import ContextLengthExceededError, InvalidRequestError, ModelNotFoundError, engine_errors_as_api
from app.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Limits,
    ModelCard,
    ModelList,
    SamplingRequest,
    TokenizeRequest,
)
from app.reasoning import starts_inside
from app.service import tokenization
from app.service.answers import chat_response, completion_response
from app.service.chat_template import ChatTemplate
from app.service.prepared import PreparedRequest, ServedResponse
from app.service.stream_chunks import StreamChunks
from app.settings import Settings
from app.tool_calls import tool_format

if TYPE_CHECKING:  # the worker (and torch) stay out of this module's imports
    from app.engine.core.worker import Worker


class CompletionService:
    def __init__(self, settings: Settings, worker: Worker):
        self.settings = settings
        self.worker = worker
        self.limits = Limits(
            max_logprobs=settings.max_logprobs,
            max_n=settings.max_n,
            max_best_of=settings.max_best_of,
            max_stop_sequences=settings.max_stop_sequences,
        )
        self.created = int(time.time())
        self.chat_template = ChatTemplate(settings, worker)
        self._fingerprint: str | None = None
        self.tool_format = tool_format(settings.tool_call_parser)
        self.json_whitespace = settings.json_whitespace  # JSON grammars' whitespace (structured outputs, forced calls)

    @property
    def system_fingerprint(self) -> str:
        """A stable id of what answers (as vLLM sends one): the weights' source and adapters, and the settings
        that change numbers (dtype, device, quantization, compiled step). It changes when any of them does."""
        if self._fingerprint is None:
            import hashlib
            import json as _json

            info = self.worker.require_ready()
            s = self.settings
            facts = [
                info.source,
                info.precision,
                list(info.adapters),
                info.vocab_size,
                info.context_length,
                *(
                    str(getattr(s, name, None))
                    for name in (
                        "dtype",
                        "device",
                        "quantize",
                        "compile",
                        "peft_weights",
                        "peft_merge",
                        "chat_template",
                        "tokenizer",
                        "revision",
                    )
                ),
            ]
            digest = hashlib.sha256(_json.dumps(facts, default=str).encode()).hexdigest()
            self._fingerprint = "fp_" + digest[:12]
        return self._fingerprint

    # -- models -----------------------------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        """The base model's served names (settings.served_model_name): the main one first, then aliases."""
        return tuple(self.settings.model_names)

    def resolve_model(self, name: str | None) -> tuple[str, str | None]:
        """(name to report, adapter) for a requested model name; 404 when it is not served."""
        info = self.worker.require_ready()
        names = self.names
        if name is None or name in names:
            return (name or names[0]), None
        if name in info.adapters:
            return name, name
        raise ModelNotFoundError(
            f"The model '{name}' does not exist. Served: {', '.join(names + info.adapters)}", param="model"
        )

    def list_models(self) -> dict:
        info = self.worker.require_ready()
        cards = [
            ModelCard(
                id=name,
                created=self.created,
                root=info.source,
                max_model_len=self.max_total_tokens,
                precision=info.precision,
            )
            for name in self.names
        ]
        adapters = self.settings.peft_adapters
        cards += [
            ModelCard(
                id=name,
                created=self.created,
                root=adapters.get(name, name),
                parent=self.names[0],
                max_model_len=self.max_total_tokens,
                precision=info.precision,
            )
            for name in info.adapters
        ]
        return ModelList(data=cards).model_dump()

    def get_model(self, model_id: str) -> dict:
        for card in self.list_models()["data"]:
            if card["id"] == model_id:
                return card
        raise ModelNotFoundError(f"The model '{model_id}' does not exist", param="model")

    # -- limits -----------------------------------------------------------------------------------------
    @property
    def max_total_tokens(self) -> int:
        info = self.worker.require_ready()
        return min(self.settings.max_total_tokens or info.context_length, info.context_length)

    @property
    def max_input_tokens(self) -> int:
        return min(self.settings.max_input_tokens or self.max_total_tokens, self.max_total_tokens)

    def _prompt_ids(self, prompt: str | list[int], vocab: int) -> list[int]:
        if isinstance(prompt, str):
            ids = self.worker.encode(prompt)
        else:
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"prompt holds token id {bad}, outside the vocabulary (0..{vocab - 1})", param="prompt"
                )
            ids = list(prompt)
        if not ids:
            # as OpenAI does: an empty prompt is conditioned on the start token (BOS, or the end-of-text token of
            # tokenizers without one, GPT-2's <|endoftext|>)
            tok = self.worker.tokenizer
            start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
            if start is None:
                raise InvalidRequestError(
                    "prompt must not be empty (it encodes to no tokens, and this "
                    "tokenizer has no start token to begin from)",
                    param="prompt",
                )
            ids = [start]
        return ids

    def _check_kv_budget(self, ids: list[int], params) -> None:
        """A request whose candidates could never fit the KV budget together is a 400 now, not a wait forever or
        an out-of-memory later: each candidate may grow to prompt + max_tokens positions, in whole blocks of the KV
        cache (a request that fits runs to its end: newer ones give their blocks back to it when blocks run out)."""
        budget = getattr(self.worker, "kv_cache_tokens", None)
        if not budget:
            return
        reach = len(ids) + (params.max_tokens if params.max_tokens is not None else self.max_total_tokens - len(ids))
        need, block = self.worker.kv_positions(reach, params.num_candidates)
        if need > budget:
            param = (
                "best_of"
                if params.best_of and params.best_of > params.n
                else "n"
                if params.num_candidates > 1
                else "max_tokens"
            )
            raise InvalidRequestError(
                f"This request needs {need} KV-cache positions ({params.num_candidates} candidates x {reach} "
                f"positions: prompt + max_tokens, in blocks of {block}), more than the server's KV budget of {budget} "
                f"(SAKER_KV_CACHE_TOKENS); ask for fewer candidates or tokens",
                param=param,
            )

    def _check_lengths(self, ids: list[int], max_tokens: int | None, param: str = "prompt") -> None:
        if len(ids) > self.max_input_tokens:
            raise ContextLengthExceededError(
                f"The prompt has {len(ids)} tokens, more than the {self.max_input_tokens} input tokens allowed",
                param=param,
            )
        total = self.max_total_tokens
        if max_tokens is not None and len(ids) + max_tokens > total:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {total} tokens. However, you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} in the completion). "
                f"Please reduce your prompt or max_tokens.",
                param="max_tokens",
            )
        if max_tokens is None and len(ids) >= total:
            raise ContextLengthExceededError(
                f"The prompt has {len(ids)} tokens and leaves no room in the {total}-token context", param=param
            )

    # -- requests ----------------------------------------------------------------------------------------
    def prepare(self, request: SamplingRequest) -> PreparedRequest:
        """Validate a request against the model and the limits; raises before anything is generated."""
        with engine_errors_as_api():
            return self._prepare(request)

    def _prepare(self, request: SamplingRequest) -> PreparedRequest:
        model_name, adapter = self.resolve_model(request.model_name)
        info = self.worker.require_ready()
        params = request.to_sampling_params(self.limits, vocab_size=info.vocab_size, adapter=adapter)
        tools = None
        if isinstance(request, ChatCompletionRequest):
            tools = request.template_tools()
            prompts = [
                self.chat_template.render(
                    request.template_messages(), request.add_generation_prompt, tools, request.template_options()
                )
            ]
            param = "messages"
            if tools:  # the call tags must reach the parser, special tokens or not
                params = replace(params, skip_special_tokens=False)
            if request.calls_tools:
                named = request.tool_choice.function.name if request.tool_mode == "named" else None
                grammar = self.tool_format.grammar(
                    [t["function"] for t in tools], named, bool(request.parallel_tool_calls), self.json_whitespace
                )
                params = replace(params, constraint=Constraint("grammar", grammar))
        else:
            assert isinstance(request, CompletionRequest)
            prompts = [self._prompt_ids(p, info.vocab_size) for p in request.prompt_list()]
            param = "prompt"
        for ids in prompts:
            self._check_lengths(ids, params.max_tokens, param)
            self._check_kv_budget(ids, params)
        if params.constraint is not None and params.constraint.kind == "json_schema":
            params = replace(params, constraint=replace(params.constraint, whitespace=self.json_whitespace))
        if params.constraint is not None:
            asked_by = "tools" if tools and request.calls_tools else request.constraint()[1]
            try:
                self.worker.compile_constraint(params.constraint)
            except ConstraintError as exc:
                raise InvalidRequestError(f"{asked_by}: {exc.detail}", param=asked_by) from None
        chat = isinstance(request, ChatCompletionRequest)
        thinks = None
        if chat and self.settings.reasoning_parser != "none":
            thinks = starts_inside(self.worker.tokenizer.decode(prompts[0][-16:]))
            if thinks and params.constraint is not None:
                thinks = None  # the prompt opened the thoughts, but a constrained answer is the format asked for
            else:
                params = replace(params, skip_special_tokens=False)  # <think> may be a special token
        return PreparedRequest(
            chat=chat,
            model=model_name,
            params=params,
            prompts=prompts,
            include_usage=request.include_usage,
            continuous_usage=request.continuous_usage,
            id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            tools=bool(tools),
            thinks=thinks,
            echoed=request.echoed if chat else None,
        )

    def complete(self, request: SamplingRequest, prepared: PreparedRequest | None = None, alive=None) -> ServedResponse:
        """A whole (non-streamed) completion or chat completion; ``prepared``: this request already prepared
        (batch mode validates every line before it runs); ``alive``: whether the client is still connected."""
        prepared = prepared or self.prepare(request)
        with engine_errors_as_api():
            outputs, timings = self.worker.complete(
                prepared.prompts, prepared.params, self.max_total_tokens, alive=alive
            )
        if prepared.chat:
            body = chat_response(prepared, outputs, timings, self.system_fingerprint, self.tool_format)
        else:
            body = completion_response(prepared, outputs, timings, self.system_fingerprint)
        return ServedResponse(body.model_dump(), timings)

    def stream(self, prepared: PreparedRequest, alive=None) -> Iterator[dict]:
        """Chunks of a streamed answer, each the response's shape; a usage chunk last when asked for. ``alive``:
        whether the client is still connected (checked while the answer is made)."""
        return StreamChunks(self, prepared).stream(alive)

    # -- tokenizer endpoints ----------------------------------------------------------------------------
    def tokenize(self, request: TokenizeRequest) -> dict:
        return tokenization.tokenize(self, request)

    def detokenize(self, request: DetokenizeRequest) -> dict:
        return tokenization.detokenize(self, request)

    def tokenizer_info(self) -> dict:
        return tokenization.tokenizer_info(self)
