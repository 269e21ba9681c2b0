"""A streamed answer (``stream: true``) as chunks in OpenAI's shape: a choice's text as it becomes final (chat:
the role first, then content, reasoning and tool-call deltas), the usage chunk last when asked for."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

from app.errors import engine_errors_as_api
from app.protocol import Usage
from app.service.answer_reader import AnswerReader, finish_reason, reader_for
from app.service.answers import chat_logprobs, completion_logprobs, timing_of

if TYPE_CHECKING:
    from app.service.completion_service import CompletionService
    from app.service.prepared import PreparedRequest


class StreamChunks:
    """The chunks of one prepared request's stream."""

    def __init__(self, service: CompletionService, prepared: PreparedRequest):
        self.service, self.prepared = service, prepared

    def stream(self, alive=None) -> Iterator[dict]:
        """Chunks of a streamed answer, each the response's shape; a usage chunk last when asked for. ``alive``:
        whether the client is still connected (checked while the answer is made)."""
        prepared = self.prepared
        n = prepared.params.n
        started: set[int] = set()
        prompt_tokens = sum(len(ids) for ids in prepared.prompts)
        with engine_errors_as_api():
            releases = self.service.worker.stream(
                prepared.prompts,
                prepared.params,
                self.service.max_total_tokens,
                prepared.timings,
                alive=alive,
            )
            with contextlib.closing(releases):
                yield from self._stream_chunks(releases, n, started)
        if prepared.include_usage:
            completion_tokens = prepared.timings.generated_tokens
            chunk = self._chunk([])
            chunk["usage"] = Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
            ).model_dump()
            chunk["timing"] = timing_of(prepared.timings).model_dump()
            yield chunk

    def _stream_chunks(self, releases, n: int, started: set[int]) -> Iterator[dict]:
        prepared = self.prepared
        chunks = self._chunks_of(releases, n, started)
        if not prepared.continuous_usage:
            yield from (chunk for chunk, _ in chunks)
            return
        prompt_tokens = sum(len(ids) for ids in prepared.prompts)
        for chunk, generated in chunks:
            chunk["usage"] = Usage(
                prompt_tokens=prompt_tokens, completion_tokens=generated, total_tokens=prompt_tokens + generated
            ).model_dump()
            yield chunk

    def _chunks_of(self, releases, n: int, started: set[int]) -> Iterator:
        """The stream's chunks; with continuous usage, each paired with the tokens generated so far."""
        prepared = self.prepared
        generated = 0
        readers: dict[int, AnswerReader | None] = {}
        for p, release in releases:
            generated += len(release.token_ids)
            index = p * n + release.index
            if index not in started:
                started.add(index)
                if prepared.chat:  # OpenAI's first chat chunk carries the role
                    chunk = self._chunk(
                        [
                            {
                                "index": index,
                                "delta": {"role": "assistant", "content": prepared.echoed or ""},
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
                and (prepared.chat or release.prompt_logprobs is None)
            ):
                continue
            reader = (
                readers[index]
                if index in readers
                else readers.setdefault(index, reader_for(prepared, self.service.tool_format))
            )
            if reader is not None:
                for chunk in self._read_chunks(index, reader, release):
                    yield chunk, generated
                continue
            if prepared.chat:
                delta = {"content": release.text} if release.text or not release.finish_reason else {}
                logprobs = chat_logprobs(release.logprobs, prepared.params.logprobs or 0)
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
            yield self._chunk([choice]), generated

    def _read_chunks(self, index: int, reader: AnswerReader, release) -> list[dict]:
        """The chat chunks of one release of an answer read for thoughts and tool calls: thoughts as
        ``reasoning`` (and ``reasoning_content``) deltas, content outside calls as it comes, and ``tool_calls``
        deltas as calls are read (a call's first delta with its id, type and name and ``arguments: ""``, then
        pieces of its arguments). A delta names each call once: a call that starts and goes on in the same
        release takes two chunks. The release's logprobs ride on the first chunk, its finish_reason on the last;
        none at all while a call or a tag is still undecided."""
        prepared = self.prepared
        thoughts, content, deltas = reader.feed(release.text, final=bool(release.finish_reason))
        delta: dict = {}
        if thoughts:
            delta["reasoning"] = delta["reasoning_content"] = thoughts
        if content:
            delta["content"] = content
        groups: list[list[dict]] = []
        for call in deltas:
            if not groups or any(entry["index"] == call.index for entry in groups[-1]):
                groups.append([])
            groups[-1].append(call.as_openai())
        logprobs = chat_logprobs(release.logprobs, prepared.params.logprobs or 0)
        if not delta and not groups and not release.finish_reason and logprobs is None:
            return []  # inside a call or a tag: nothing to say yet
        deltas_out = [{**delta, "tool_calls": groups[0]} if groups else delta]
        deltas_out += [{"tool_calls": group} for group in groups[1:]]
        last = len(deltas_out) - 1
        return [
            self._chunk(
                [
                    {
                        "index": index,
                        "delta": d,
                        "logprobs": logprobs.model_dump() if logprobs and i == 0 else None,
                        "finish_reason": finish_reason(release.finish_reason, bool(reader.calls))
                        if i == last
                        else None,
                    }
                ],
            )
            for i, d in enumerate(deltas_out)
        ]

    def _chunk(self, choices: list[dict]) -> dict:
        prepared = self.prepared
        return {
            "id": prepared.id,
            "object": "chat.completion.chunk" if prepared.chat else "text_completion",
            "created": prepared.created,
            "model": prepared.model,
            "system_fingerprint": self.service.system_fingerprint,
            "choices": choices,
        }
