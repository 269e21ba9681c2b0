"""Engine results -> OpenAI responses. No Flask and no torch here: the worker does the model work."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from app.engine.params import Timings
from app.engine.worker import Worker
from app.errors import ContextLengthExceededError, InvalidRequestError, ModelNotFoundError
from app.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Limits,
                          ModelCard, ModelList, Timing, Usage)
from app.settings import Settings


@dataclass
class ServedResponse:
    body: dict
    timings: Timings


class CompletionService:
    def __init__(self, settings: Settings, worker: Worker):
        self.settings = settings
        self.worker = worker
        self.limits = Limits(max_logprobs=settings.max_logprobs, max_n=settings.max_n,
                             max_best_of=settings.max_best_of, max_stop_sequences=settings.max_stop_sequences)
        self.created = int(time.time())

    # -- models -----------------------------------------------------------------------------------------
    def resolve_model(self, name: str | None) -> tuple[str, str | None]:
        """(name to report, adapter) for a requested model name; 404 when it is not served."""
        info = self.worker.require_ready()
        names = self.names
        if name is None or name in names:
            return (name or names[0]), None
        if name in info.adapters:
            return name, name
        raise ModelNotFoundError(f"The model '{name}' does not exist. Served: "
                                 f"{', '.join(names + info.adapters)}", param="model")

    @property
    def names(self) -> tuple[str, ...]:
        """The base model's served names (settings.served_model_name): the main one first, then aliases."""
        return tuple(self.settings.model_names)

    def list_models(self) -> dict:
        info = self.worker.require_ready()
        cards = [ModelCard(id=name, created=self.created, root=info.source, max_model_len=self.max_total_tokens)
                 for name in self.names]
        adapters = self.settings.peft_adapters
        cards += [ModelCard(id=name, created=self.created, root=adapters.get(name, name), parent=self.names[0],
                            max_model_len=self.max_total_tokens) for name in info.adapters]
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
                raise InvalidRequestError(f"prompt holds token id {bad}, outside the vocabulary (0..{vocab - 1})",
                                          param="prompt")
            ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt must not be empty (it encodes to no tokens)", param="prompt")
        return ids

    def _check_lengths(self, ids: list[int], max_tokens: int | None) -> None:
        if len(ids) > self.max_input_tokens:
            raise ContextLengthExceededError(
                f"The prompt has {len(ids)} tokens, more than the {self.max_input_tokens} input tokens allowed",
                param="prompt")
        total = self.max_total_tokens
        if max_tokens is not None and len(ids) + max_tokens > total:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {total} tokens. However, you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} in the completion). "
                f"Please reduce your prompt or max_tokens.", param="max_tokens")
        if max_tokens is None and len(ids) >= total:
            raise ContextLengthExceededError(
                f"The prompt has {len(ids)} tokens and leaves no room in the {total}-token context",
                param="prompt")

    # -- completions ------------------------------------------------------------------------------------
    def complete(self, request: CompletionRequest) -> ServedResponse:
        model_name, adapter = self.resolve_model(request.model_name)
        info = self.worker.require_ready()
        params = request.to_sampling_params(self.limits, vocab_size=info.vocab_size, adapter=adapter)
        prompts = [self._prompt_ids(p, info.vocab_size) for p in request.prompt_list()]
        for ids in prompts:
            self._check_lengths(ids, params.max_tokens)
        outputs, timings = self.worker.complete(prompts, params, self.max_total_tokens)
        choices = []
        prompt_tokens = completion_tokens = 0
        for p, out in enumerate(outputs):
            prompt_tokens += out.prompt_tokens
            completion_tokens += out.completion_tokens
            for j, choice in enumerate(out.choices):
                logprobs = None
                if choice.logprobs is not None:
                    lp = choice.logprobs
                    logprobs = CompletionLogprobs(tokens=lp.tokens, token_logprobs=lp.token_logprobs,
                                                  top_logprobs=lp.top_logprobs, text_offset=lp.text_offset)
                choices.append(CompletionChoice(text=choice.text, index=p * params.n + j, logprobs=logprobs,
                                                finish_reason=choice.finish_reason))
        response = CompletionResponse(
            id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model_name,
            choices=choices,
            usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                        total_tokens=prompt_tokens + completion_tokens),
            timing=timing_of(timings))
        return ServedResponse(response.model_dump(), timings)


def timing_of(timings: Timings) -> Timing:
    return Timing(queue_ms=round(timings.queue_s * 1000, 3), prefill_ms=round(timings.prefill_s * 1000, 3),
                  decode_ms=round(timings.decode_s * 1000, 3),
                  tokens_per_second=round(timings.tokens_per_second, 3))
