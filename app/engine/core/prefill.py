"""A prompt computed chunk by chunk inside the batch's steps (``ChunkedPrefill``), then its first tokens sampled and
its group joined to the batch on its blocks (``join``); a preempted group's rows computed again the same way.
"""

from __future__ import annotations

import time

import torch

from app.engine.core.batches import BlockBatch
from app.engine.core.blocks import BLOCK
from app.engine.core.sequence import RequestGroup, Status
from app.engine.core.step import Event, sample_step


class ChunkedPrefill:
    """A prompt computed at most ``chunk`` tokens at a time into blocks the batch reserves for it (``start``; the
    leading blocks a kept prompt shares come from the prefix cache). Each chunk is computed inside one of the
    batch's steps (``compute_chunks``): beside the running rows' decode tokens in one flat forward
    (``decode_step(batch, jobs)``), or alone when nothing runs or the rows use another adapter. The running rows
    never wait for a prefill forward of its own. Prompt logprobs are taken chunk by chunk, so no more than a chunk's
    logits are held. Once the whole prompt is in, ``finish`` samples the first tokens and the group joins the batch
    on those blocks.

    A preempted group (``group.preempted``) is computed the same way, one sequence per candidate (its prompt and
    the tokens it made but the next one), one after another; then its rows join with their next tokens and
    sampling state as they were, so that they go on as if they had never left."""

    def __init__(self, group: RequestGroup, chunk: int):
        self.group, self.chunk = group, max(1, chunk)
        # the sequences it computes, each into blocks of its own (its ``block_table``, its progress its
        # ``num_computed_tokens``): the prompt, held by the first candidate until the group joins, or each preempted
        # row (its prompt and the tokens it made but the next one)
        self.seqs = list(group.running) if group.preempted else [group.seqs[0]]
        self.ids_of = (
            [(seq.prompt_ids + seq.output_ids)[:-1] for seq in self.seqs] if group.preempted else [group.prompt_ids]
        )
        self.spare: list[int] = []  # blocks for the other candidates' copies of the prompt's partial last block
        self.keys_of: list[list] = []  # the chained keys of each one's full blocks (prefix caching)
        self.row = 0  # the sequence being computed
        self.last: torch.Tensor | None = None  # the last prompt position's logits (1, 1, V)
        self.spent = 0.0  # seconds of steps that carried its chunks

    @property
    def ids(self) -> list[int]:
        return self.ids_of[self.row]

    @property
    def table(self) -> list[int]:
        return self.seqs[self.row].block_table

    @property
    def done(self) -> int:
        """The tokens of the sequence being computed that are in (computed, or from the prefix cache)."""
        return self.seqs[self.row].num_computed_tokens

    def start(self, batch: BlockBatch) -> None:
        """Reserve the blocks of its sequences, their leading ones from the prefix cache when a kept prompt shares
        them (not when every position's logits are asked for: those of cached positions are not kept)."""
        group = self.group
        salt = batch.runner.prefix_salt(group.params.adapter)
        reuse = group.preempted or not group.needs_prompt_logits
        group.status = Status.PREFILLING
        for seq, ids in zip(self.seqs, self.ids_of):
            table, keys, cached = batch.reserve(ids, salt, reuse=reuse)
            seq.block_table, seq.num_computed_tokens = table, cached
            self.keys_of.append(keys)
        if not group.preempted:
            group.timings.cached_tokens += self.done
            self.spare = batch.spare_blocks(group)

    @property
    def remaining(self) -> int:
        pending = zip(self.ids_of[self.row :], self.seqs[self.row :])
        return sum(len(ids) - seq.num_computed_tokens for ids, seq in pending)

    def next_chunk(self, budget: int) -> list[int]:
        """The next tokens to compute: at most a chunk, and no more than ``budget``."""
        return self.ids[self.done : self.done + min(self.chunk, budget)]

    def logits_wanted(self, count: int) -> str:
        """Which of the next chunk's logits a step computes: every position's (prompt scoring), the last one
        when the chunk ends the prompt (the first tokens come from it), or none (a preempted group's rows have their
        next tokens)."""
        if self.group.preempted:
            return "none"
        if self.group.needs_prompt_logits:
            return "all"
        return "last" if self.done + count == len(self.ids) else "none"

    def took(self, batch: BlockBatch, logits: torch.Tensor, count: int, seconds: float) -> bool:
        """A step computed the next ``count`` tokens (``logits`` as ``logits_wanted`` asked): the full blocks they
        completed go to the prefix cache. True once every sequence is in."""
        group = self.group
        if group.needs_prompt_logits and not group.preempted:
            group.score_prompt(logits, self.done)
        batch.register(self.table, self.keys_of[self.row], self.done, self.done + count)
        self.seqs[self.row].num_computed_tokens += count
        self.spent += seconds
        if self.done < len(self.ids):
            return False
        if self.row + 1 < len(self.ids_of):
            self.row += 1
            return False
        if not group.preempted:
            self.last = logits[-1:].unsqueeze(0)
        return True

    def _chain(self, row: int) -> int:
        full, keys = len(self.ids_of[row]) // BLOCK, self.keys_of[row]
        return hash(keys[full - 1]) if full and len(keys) >= full else 0

    def finish(self, batch: BlockBatch) -> list[Event]:
        """The prompt is in: its first tokens, and its rows join the batch on its blocks (which it holds until
        they are the batch's, so that a failure before that gives them back: ``abandon``)."""
        group = self.group
        if not group.preempted:
            start = time.perf_counter() - self.spent
            events = join(batch, group, self.last, start, self._chain(0), self.spare)
            self.seqs, self.spare = [], []
            return events
        chains = [self._chain(row) for row in range(len(self.seqs))]
        tokens, sampling = batch.unpark(group)
        group.status = Status.RUNNING
        for seq in group.running:
            seq.status = Status.RUNNING
        prompts, self.seqs = len(self.seqs), []
        batch.add_rows(group, chains, tokens, sampling, prompts=prompts)
        group.timings.prefill_s += self.spent
        return []

    def abandon(self, batch: BlockBatch) -> None:
        """The request left or failed before its prompt was in: its blocks are let go."""
        spare, self.spare = self.spare, []
        for seq in self.seqs:
            if seq.block_table:
                batch.unreserve(seq.block_table, spare)
                spare = []
            seq.block_table, seq.num_computed_tokens = [], 0
        batch.blocks.release(spare)
        self.seqs = []


def join(
    batch: BlockBatch,
    group: RequestGroup,
    logits: torch.Tensor,
    start: float,
    chain: int = 0,
    spare: list[int] = (),
) -> list[Event]:
    """After a group's prompt was computed into the blocks its first candidate holds (its last position's logits
    (1, 1, V); ``chain``: the hash of its last full block's prefix-cache key; ``spare``: blocks for the other
    candidates' partial-block copies): the prompt's numbers, the first tokens, and the group in the batch if it goes
    on."""
    events: list[Event] = [group.prompt_numbers()]
    holder = group.seqs[0]
    table = holder.block_table
    if not group.generates:
        group.timings.prefill_s += time.perf_counter() - start
        batch.unreserve(table, spare)
        holder.block_table = []
        group.status = Status.FINISHED
        return events
    last = logits[:, -1, :].float()
    count = group.params.num_candidates
    sampling = group.begin(last.device, last.shape[-1])
    if count > 1:
        last = last.expand(count, last.shape[-1])
    batch.runner.inject("sample")
    [(first, keep)], tokens = sample_step([group], last, sampling)
    events += first
    group.select(keep)
    if keep:
        if len(keep) < count:
            tokens = tokens.index_select(0, torch.tensor(keep, device=tokens.device))
            sampling = sampling.select(keep)
        batch.add_reserved(group, table, tokens, sampling, chain, spare)
        group.status = Status.RUNNING
    else:  # every candidate ended on its first token
        batch.unreserve(table, spare)
        holder.block_table = []
        group.status = Status.FINISHED
    group.timings.prefill_s += time.perf_counter() - start
    return events
