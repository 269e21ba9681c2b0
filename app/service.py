"""Engine results -> OpenAI responses and stream chunks. No Flask and no torch here: the worker does the
model work, ``app/api.py`` does HTTP."""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Iterator

from app.engine.params import Constraint, SamplingParams, Timings, TokenLogprobs
from app.errors import ContextLengthExceededError, InvalidRequestError, ModelNotFoundError
from app.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    Limits,
    ModelCard,
    ModelList,
    SamplingRequest,
    Timing,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    Usage,
)
from app.settings import Settings
from app.reasoning import ThinkStream, starts_inside
from app.tool_calls import ToolCallStream, tool_format

if TYPE_CHECKING:  # the worker (and torch) stay out of this module's imports
    from app.engine.worker import Worker


@dataclass
class ServedResponse:
    body: dict
    timings: Timings


@dataclass
class Job:
    """A validated request, ready for the worker."""

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
        self._chat_template = None
        self._takes_tools: bool | None = None
        self._fingerprint: str | None = None
        self.tool_format = tool_format(settings.tool_call_parser)

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
            ModelCard(id=name, created=self.created, root=info.source, max_model_len=self.max_total_tokens)
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
        an out-of-memory later: each candidate may grow to prompt + max_tokens positions."""
        budget = getattr(self.worker, "kv_cache_tokens", None)
        if not budget:
            return
        reach = len(ids) + (params.max_tokens if params.max_tokens is not None else self.max_total_tokens - len(ids))
        need = params.num_candidates * reach
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
                f"positions: prompt + max_tokens), more than the server's KV budget of {budget} "
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

    # -- chat template ----------------------------------------------------------------------------------
    def chat_template(self) -> str | None:
        """SAKER_CHAT_TEMPLATE (a file or an inline Jinja string), else the tokenizer's own."""
        if self._chat_template is None:
            self._chat_template = (
                self.settings.chat_template_text() or getattr(self.worker.tokenizer, "chat_template", None) or ""
            )
        return self._chat_template or None

    def _apply_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        tokenize: bool,
        tools: list[dict] | None = None,
        options: dict | None = None,
    ):
        template = self.chat_template()
        if not template:
            raise InvalidRequestError(
                "This model has no chat template. Set one with SAKER_CHAT_TEMPLATE (a Jinja file or string), "
                "or use /v1/completions",
                param="messages",
            )
        try:
            return self.worker.tokenizer.apply_chat_template(
                messages,
                chat_template=template,
                tokenize=tokenize,
                add_generation_prompt=add_generation_prompt,
                return_dict=False,
                tools=tools,
                **(options or {}),
            )
        except Exception as exc:
            raise InvalidRequestError(
                f"the chat template could not render these messages: {exc}", param="messages"
            ) from None

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        options: dict | None = None,
    ) -> list[int]:
        """Token ids of the rendered conversation; the template carries BOS, none is added a second time."""
        if tools and not self.template_takes_tools():
            raise InvalidRequestError(
                "This model's chat template does not render tools, so the model would never "
                "see them. Use a template that does (SAKER_CHAT_TEMPLATE), or leave tools "
                "out",
                param="tools",
            )
        ids = self._apply_template(messages, add_generation_prompt, tokenize=True, tools=tools, options=options)
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        return list(ids)

    def template_takes_tools(self) -> bool:
        """Whether the chat template renders ``tools`` (a probe conversation comes out different with one)."""
        if self._takes_tools is None:
            probe = [{"role": "user", "content": "hi"}]
            tool = [
                {
                    "type": "function",
                    "function": {
                        "name": "saker_probe_tool",
                        "description": "probe",
                        "parameters": {"type": "object", "properties": {}},
                    },
                }
            ]
            plain = self._apply_template(probe, True, tokenize=False)  # a template that fails says so itself
            try:
                self._takes_tools = self._apply_template(probe, True, tokenize=False, tools=tool) != plain
            except InvalidRequestError:
                self._takes_tools = False
        return self._takes_tools

    # -- jobs -------------------------------------------------------------------------------------------
    def prepare(self, request: SamplingRequest) -> Job:
        """Validate a request against the model and the limits; raises before anything is generated."""
        model_name, adapter = self.resolve_model(request.model_name)
        info = self.worker.require_ready()
        params = request.to_sampling_params(self.limits, vocab_size=info.vocab_size, adapter=adapter)
        tools = None
        if isinstance(request, ChatCompletionRequest):
            tools = request.template_tools()
            prompts = [
                self.render_chat(
                    request.template_messages(), request.add_generation_prompt, tools, request.template_options()
                )
            ]
            param = "messages"
            if tools:  # the call tags must reach the parser, special tokens or not
                params = replace(params, skip_special_tokens=False)
            if request.calls_tools:
                named = request.tool_choice.function.name if request.tool_mode == "named" else None
                grammar = self.tool_format.grammar(
                    [t["function"] for t in tools], named, bool(request.parallel_tool_calls)
                )
                params = replace(params, constraint=Constraint("grammar", grammar))
        else:
            assert isinstance(request, CompletionRequest)
            prompts = [self._prompt_ids(p, info.vocab_size) for p in request.prompt_list()]
            param = "prompt"
        for ids in prompts:
            self._check_lengths(ids, params.max_tokens, param)
            self._check_kv_budget(ids, params)
        if params.constraint is not None:
            asked_by = "tools" if tools and request.calls_tools else request.constraint()[1]
            self.worker.compile_constraint(params.constraint, asked_by)
        chat = isinstance(request, ChatCompletionRequest)
        thinks = None
        if chat and self.settings.reasoning_parser != "none":
            thinks = starts_inside(self.worker.tokenizer.decode(prompts[0][-16:]))
            if thinks and params.constraint is not None:
                thinks = None  # the prompt opened the thoughts, but a constrained answer is the format asked for
            else:
                params = replace(params, skip_special_tokens=False)  # <think> may be a special token
        return Job(
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

    def complete(self, request: SamplingRequest, job: Job | None = None, alive=None) -> ServedResponse:
        """A whole (non-streamed) completion or chat completion; ``job``: this request already prepared (batch
        mode validates every line before it runs); ``alive``: whether the client is still connected."""
        job = job or self.prepare(request)
        outputs, timings = self.worker.complete(job.prompts, job.params, self.max_total_tokens, alive=alive)
        n = job.params.n
        prompt_tokens = sum(o.prompt_tokens for o in outputs)
        completion_tokens = sum(o.completion_tokens for o in outputs)
        usage = Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )
        if job.chat:
            chat_choices = [
                self._chat_choice(job, p * n + j, c) for p, out in enumerate(outputs) for j, c in enumerate(out.choices)
            ]
            body = ChatCompletionResponse(
                id=job.id,
                created=job.created,
                model=job.model,
                choices=chat_choices,
                usage=usage,
                timing=timing_of(timings),
                system_fingerprint=self.system_fingerprint,
                prompt_logprobs=outputs[0].prompt_logprobs,
            )
        else:
            choices = [
                CompletionChoice(
                    text=c.text,
                    index=p * n + j,
                    logprobs=completion_logprobs(c.logprobs),
                    finish_reason=c.finish_reason,
                    prompt_logprobs=out.prompt_logprobs,
                )
                for p, out in enumerate(outputs)
                for j, c in enumerate(out.choices)
            ]
            body = CompletionResponse(
                id=job.id,
                created=job.created,
                model=job.model,
                choices=choices,
                usage=usage,
                timing=timing_of(timings),
                system_fingerprint=self.system_fingerprint,
            )
        return ServedResponse(body.model_dump(), timings)

    def _reader(self, job: Job) -> "AnswerReader | None":
        """What reads a chat choice's text: thoughts (reasoning parser) and tool calls apart from the content."""
        if not job.chat or (not job.tools and job.thinks is None):
            return None
        return AnswerReader(
            ThinkStream(job.thinks) if job.thinks is not None else None,
            ToolCallStream(self.tool_format) if job.tools else None,
        )

    def _chat_choice(self, job: Job, index: int, choice) -> ChatChoice:
        """One chat choice; with tools, the calls are read out of the text and the rest is the content; with a
        reasoning parser, the thoughts too."""
        message = ChatResponseMessage(content=choice.text)
        reader = self._reader(job)
        if reader is not None:
            thoughts, content, calls = reader.feed(choice.text, final=True)
            message = ChatResponseMessage(
                content=content or (None if calls or job.tools else content),
                tool_calls=[call.as_openai() for call in calls] or None,
            )
            if job.thinks is not None:
                message.reasoning = message.reasoning_content = thoughts or None
        if job.echoed:
            message.content = job.echoed + (message.content or "")
        return ChatChoice(
            index=index,
            message=message,
            logprobs=chat_logprobs(choice.logprobs, job.params.logprobs or 0),
            finish_reason=_finish(choice.finish_reason, bool(message.tool_calls)),
        )

    def stream(self, job: Job, alive=None) -> Iterator[dict]:
        """Chunks of a streamed answer, each the response's shape; a usage chunk last when asked for. ``alive``:
        whether the client is still connected (checked while the answer is made)."""
        n = job.params.n
        started: set[int] = set()
        prompt_tokens = sum(len(ids) for ids in job.prompts)
        releases = self.worker.stream(job.prompts, job.params, self.max_total_tokens, job.timings, alive=alive)
        with contextlib.closing(releases):
            yield from self._stream_chunks(job, releases, n, started)
        if job.include_usage:
            completion_tokens = job.timings.generated_tokens
            chunk = self._chunk(job, [])
            chunk["usage"] = Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
            ).model_dump()
            chunk["timing"] = timing_of(job.timings).model_dump()
            yield chunk

    def _stream_chunks(self, job: Job, releases, n: int, started: set[int]) -> Iterator[dict]:
        chunks = self._chunks_of(job, releases, n, started)
        if not job.continuous_usage:
            yield from (chunk for chunk, _ in chunks)
            return
        prompt_tokens = sum(len(ids) for ids in job.prompts)
        for chunk, generated in chunks:
            chunk["usage"] = Usage(
                prompt_tokens=prompt_tokens, completion_tokens=generated, total_tokens=prompt_tokens + generated
            ).model_dump()
            yield chunk

    def _chunks_of(self, job: Job, releases, n: int, started: set[int]) -> Iterator:
        """The stream's chunks; with continuous usage, each paired with the tokens generated so far."""
        generated = 0
        readers: dict[int, AnswerReader | None] = {}
        for p, release in releases:
            generated += len(release.token_ids)
            index = p * n + release.index
            if index not in started:
                started.add(index)
                if job.chat:  # OpenAI's first chat chunk carries the role
                    chunk = self._chunk(
                        job,
                        [
                            {
                                "index": index,
                                "delta": {"role": "assistant", "content": job.echoed or ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    )
                    if release.prompt_logprobs is not None:
                        chunk["prompt_logprobs"] = release.prompt_logprobs
                    yield chunk, generated
            if (
                not release.text
                and not release.finish_reason
                and not (release.logprobs and release.logprobs.tokens)
                and (job.chat or release.prompt_logprobs is None)
            ):
                continue
            reader = readers[index] if index in readers else readers.setdefault(index, self._reader(job))
            if reader is not None:
                chunk = self._read_chunk(job, index, reader, release)
                if chunk is not None:
                    yield chunk, generated
                continue
            if job.chat:
                delta = {"content": release.text} if release.text or not release.finish_reason else {}
                logprobs = chat_logprobs(release.logprobs, job.params.logprobs or 0)
                choice = {
                    "index": index,
                    "delta": delta,
                    "logprobs": logprobs.model_dump() if logprobs else None,
                    "finish_reason": release.finish_reason,
                }
            else:
                logprobs = completion_logprobs(release.logprobs)
                choice = {
                    "text": release.text,
                    "index": index,
                    "logprobs": logprobs.model_dump() if logprobs else None,
                    "finish_reason": release.finish_reason,
                }
                if release.prompt_logprobs is not None:  # the prompt's release, first of its choice
                    choice["prompt_logprobs"] = release.prompt_logprobs
            yield self._chunk(job, [choice]), generated

    def _read_chunk(self, job: Job, index: int, reader: "AnswerReader", release) -> dict | None:
        """A chat chunk of an answer read for thoughts and tool calls: thoughts as ``reasoning`` (and
        ``reasoning_content``) deltas, content outside calls as it comes, each call as one ``tool_calls`` delta
        (id, name and whole arguments) once its closing tag is in."""
        thoughts, content, calls = reader.feed(release.text, final=bool(release.finish_reason))
        delta: dict = {}
        if thoughts:
            delta["reasoning"] = delta["reasoning_content"] = thoughts
        if content:
            delta["content"] = content
        if calls:
            first = reader.calls - len(calls)
            delta["tool_calls"] = [{"index": first + i, **call.as_openai()} for i, call in enumerate(calls)]
        logprobs = chat_logprobs(release.logprobs, job.params.logprobs or 0)
        if not delta and not release.finish_reason and logprobs is None:
            return None  # inside a call or a tag: nothing to say yet
        return self._chunk(
            job,
            [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": logprobs.model_dump() if logprobs else None,
                    "finish_reason": _finish(release.finish_reason, reader.calls > 0),
                }
            ],
        )

    def _chunk(self, job: Job, choices: list[dict]) -> dict:
        return {
            "id": job.id,
            "object": "chat.completion.chunk" if job.chat else "text_completion",
            "created": job.created,
            "model": job.model,
            "system_fingerprint": self.system_fingerprint,
            "choices": choices,
        }

    # -- tokenizer endpoints ----------------------------------------------------------------------------
    def tokenize(self, request: TokenizeRequest) -> dict:
        self.resolve_model(request.model)
        tok = self.worker.tokenizer
        if request.messages is not None:
            messages = [m.as_template_message() for m in request.messages]
            tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
            if request.add_special_tokens:
                text = self._apply_template(
                    messages,
                    request.add_generation_prompt,
                    tokenize=False,
                    tools=tools,
                    options=request.template_options(),
                )
                ids = list(tok(text, add_special_tokens=True)["input_ids"])
            else:
                ids = self.render_chat(messages, request.add_generation_prompt, tools, request.template_options())
        else:
            add = True if request.add_special_tokens is None else request.add_special_tokens
            ids = list(tok(request.prompt, add_special_tokens=add)["input_ids"])
        strs = tok.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=self.max_total_tokens, tokens=ids, token_strs=strs
        ).model_dump()

    def detokenize(self, request: DetokenizeRequest) -> dict:
        self.resolve_model(request.model)
        vocab = self.worker.require_ready().vocab_size
        bad = next((t for t in request.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"tokens holds {bad}, outside the vocabulary (0..{vocab - 1})", param="tokens")
        return DetokenizeResponse(prompt=self.worker.tokenizer.decode(request.tokens)).model_dump()

    def tokenizer_info(self) -> dict:
        tok = self.worker.tokenizer
        info = self.worker.require_ready()
        return TokenizerInfo(
            tokenizer_class=type(tok).__name__,
            eos_token=tok.eos_token,
            eos_token_id=tok.eos_token_id,
            bos_token=tok.bos_token,
            bos_token_id=tok.bos_token_id,
            pad_token=tok.pad_token,
            pad_token_id=tok.pad_token_id,
            unk_token=tok.unk_token,
            model_max_length=self.max_total_tokens,
            vocab_size=info.vocab_size,
            chat_template=self.chat_template(),
            add_bos_token=adds_bos(tok),
        ).model_dump()


class AnswerReader:
    """One chat choice's text as the client sees it: thoughts (a reasoning parser), then content and tool calls
    (tools). The same reader serves whole answers (fed at once) and streams, so both say the same."""

    def __init__(self, think: ThinkStream | None, tools: ToolCallStream | None):
        self.think, self.tools = think, tools

    @property
    def calls(self) -> int:
        return self.tools.calls if self.tools is not None else 0

    def feed(self, text: str, final: bool) -> tuple[str, str, list]:
        thoughts, content = self.think.feed(text) if self.think is not None else ("", text)
        if final and self.think is not None:
            more_thoughts, more_content = self.think.finish()
            thoughts, content = thoughts + more_thoughts, content + more_content
        calls: list = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if final:
                tail, more = self.tools.finish()
                content, calls = content + tail, calls + more
        return thoughts, content, calls


def _finish(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish_reason: tool_calls when an answer that ended on its own made calls."""
    return "tool_calls" if reason == "stop" and called else reason


def adds_bos(tok) -> bool:
    """Whether encoding a text puts BOS first (what the tokenizer does, not what its config claims)."""
    ids = tok("a")["input_ids"]
    return bool(ids) and tok.bos_token_id is not None and ids[0] == tok.bos_token_id


def completion_logprobs(lp: TokenLogprobs | None) -> CompletionLogprobs | None:
    if lp is None:
        return None
    return CompletionLogprobs(
        tokens=lp.tokens, token_logprobs=lp.token_logprobs, top_logprobs=lp.top_logprobs, text_offset=lp.text_offset
    )


def key_bytes(key: str) -> list[int]:
    """The bytes of a top_logprobs key: ``bytes:\\xNN..`` keys are raw bytes, others UTF-8 text."""
    if key.startswith("bytes:"):
        hexes = key[len("bytes:") :].split("\\x")[1:]
        try:
            return [int(h[:2], 16) for h in hexes]
        except ValueError:
            pass
    return list(key.encode("utf-8"))


def chat_logprobs(lp: TokenLogprobs | None, top_logprobs: int) -> ChatChoiceLogprobs | None:
    """OpenAI's chat shape: one entry per token with its bytes and its ``top_logprobs`` most likely
    alternatives (the chosen token is listed there only when it is among them)."""
    if lp is None:
        return None
    content = []
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        ranked = sorted((top or {}).items(), key=lambda kv: -kv[1])[:top_logprobs]
        alternatives = [ChatTopLogprob(token=k, logprob=v, bytes=key_bytes(k)) for k, v in ranked]
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=logprob if logprob is not None else 0.0,
                bytes=list(token.encode("utf-8")),
                top_logprobs=alternatives,
            )
        )
    return ChatChoiceLogprobs(content=content)


def timing_of(timings: Timings) -> Timing:
    return Timing(
        queue_ms=round(timings.queue_s * 1000, 3),
        prefill_ms=round(timings.prefill_s * 1000, 3),
        decode_ms=round(timings.decode_s * 1000, 3),
        tokens_per_second=round(timings.tokens_per_second, 3),
        cached_prompt_tokens=timings.cached_tokens,
    )
