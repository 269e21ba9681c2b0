"""One prompt run alone, start to end, in a batch of its own (warm-up, tests and tools): its prompt computed in one
flat forward (``admit``), then decode steps until its candidates end, its text made between steps (``SoloRun``).
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from app.engine.core.batches import BlockBatch
from app.engine.events import PromptEvent, TokenEvent
from app.engine.params import SamplingParams, Timings
from app.engine.core.prefill import ChunkedPrefill
from app.engine.model.runner import ModelRunner
from app.engine.core.sequence import RequestGroup
from app.engine.core.step import Event, compute_chunks, decode_step, drop_finished


def admit(batch: BlockBatch, group: RequestGroup) -> list[Event]:
    """Compute a group's prompt in a step of its own, sample its first tokens and, if it goes on, add it to the batch
    (a prompt with nothing to compute gives its numbers at once). Returns its events so far: the prompt's, then its
    first tokens'. The scheduler computes prompts in its steps instead (``ChunkedPrefill``); this is for a solo run."""
    if not group.prefills:
        return [group.prompt_numbers()]
    job = ChunkedPrefill(group, len(group.prompt_ids))
    job.start(batch)
    compute_chunks(batch, [(job, job.next_chunk(job.remaining))], with_rows=False)
    return job.finish(batch)


class SoloRun:
    """One prompt run alone, start to end: its text events (warm-up, tests and tools). Decoding happens here,
    between steps, as a request's thread does it for the scheduler's batch."""

    def __init__(
        self,
        runner: ModelRunner,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        max_length: int,
        timings: Timings | None = None,
    ):
        self.runner = runner
        self.group = RequestGroup(runner, prompt_ids, params, max_length=max_length, timings=timings)
        self.group.make_grammars(runner)

    def __iter__(self) -> Iterator[PromptEvent | TokenEvent]:
        from app.engine.output.decoder import RequestDecoder

        group = self.group
        runner = self.runner
        decoder = RequestDecoder(group, runner.tokenizer, runner.byte_level)
        with runner.adapter(group.params.adapter), torch.inference_mode():
            batch = BlockBatch(runner)
            for numbers in admit(batch, group):
                yield from decoder.push(numbers)
            start = time.perf_counter()
            try:
                while batch.groups:
                    drop_finished(batch)
                    if not batch.groups:
                        break
                    for _, events in decode_step(batch):
                        for numbers in events:
                            yield from decoder.push(numbers)
            finally:
                group.timings.decode_s += time.perf_counter() - start
                group.timings.generated_tokens += decoder.generated_tokens
