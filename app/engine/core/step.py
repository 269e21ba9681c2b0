"""One step of the running batch: the flat forward of every row's next token (and its guesses) with the prompt
chunks riding in it (``compute_chunks``, ``decode_step``), the batch-wide sampler and each group's token-level stops
(``sample_step``, ``verify_step`` for rows that carried guesses), and rows leaving the batch (``drop``,
``drop_finished``, ``preempt``). Logprobs come from the logits of the forward that picked the token.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from app.engine.core.batches import BlockBatch
from app.engine.events import PromptNumbers, TokenNumbers
from app.engine.model.runner import MIXED
from app.engine.sampling.sampler import SamplingRows, sample
from app.engine.core.sequence import RequestGroup, Status

if TYPE_CHECKING:  # a type only: prefill imports this module
    from app.engine.core.prefill import ChunkedPrefill


def sample_step(
    groups: list[RequestGroup], logits: torch.Tensor, rows: SamplingRows
) -> tuple[list[tuple[list[TokenNumbers], list[int]]], torch.Tensor]:
    """One step for groups whose rows are consecutive in ``logits`` (B, V) and in ``rows``: the batch-wide
    sampler, one transfer to the host, then each group's token-level stops. Returns each group's (events, rows
    that go on) and the tokens (B,) on the device."""
    tokens, numbers = sample(logits, rows)
    out, offset = [], 0
    for group in groups:
        out.append(group.settle(numbers, offset))
        offset += group.rows
    return out, tokens


def verify_step(
    batch: BlockBatch, groups: list[RequestGroup], logits: torch.Tensor, guesses: list[list[int]]
) -> tuple[list[tuple[list[TokenNumbers], list[int]]], torch.Tensor]:
    """A step whose rows carried guesses (``logits``: each row's next token's, then its guesses', a row's in a
    run). The sampler runs at every one of those positions as the row would stand there (``SamplingRows.expand``:
    its own draw for that step, the guesses before it in its history); a row keeps its guesses while each is what
    the sampler picked at the position before it, and makes those tokens plus the sampler's pick after the last
    one kept. So its tokens, logprobs and seeded samples are what they are without guesses (sample-and-match).
    Returns each group's (events, rows that go on) and each row's next token (B,) on the device."""
    rows = batch.sampling
    masks = {}  # constrained rows with guesses: the masks of their positions
    if rows.grammars is not None:
        masks = {row: rows.grammars[row].masks_along(guesses[row]) for row in rows.constrained if guesses[row]}
    picked, numbers = sample(logits, rows.expand(guesses, masks), advance=False)
    per_row = np.fromiter((1 + len(g) for g in guesses), dtype=np.int64, count=len(guesses))
    starts = np.cumsum(per_row) - per_row
    width = int(per_row.max()) - 1
    chosen = np.asarray(numbers.tokens, dtype=np.int64)
    guessed = np.full((len(guesses), width), -1, dtype=np.int64)
    for row, guess in enumerate(guesses):
        guessed[row, : len(guess)] = guess
    # the sampler's pick at each position before a guess (clipped where the row has no such guess: -1 never matches)
    before = chosen[np.minimum(starts.reshape(-1, 1) + np.arange(width), chosen.size - 1)]
    accepted = np.cumprod(before == guessed, axis=1).sum(axis=1)
    runs = [list(range(start, start + kept + 1)) for start, kept in zip(starts.tolist(), accepted.tolist())]
    made = [chosen[run].tolist() for run in runs]
    numbers.complete = rows.advance_grammar_runs(made, starts.tolist())
    batch.speculation.verified(groups, guesses, accepted.tolist())
    out, row = [], 0
    for group in groups:
        out.append(group.settle(numbers, 0, runs[row : row + group.rows]))
        row += group.rows
    rows.record_runs(made)
    batch.advance(accepted + 1)
    last = torch.from_numpy(starts + accepted).to(picked.device)
    return out, picked.index_select(0, last)


Event = PromptNumbers | TokenNumbers


def preempt(batch: BlockBatch, group: RequestGroup) -> None:
    """Take a running group's rows out of the batch and let their blocks go (full blocks stay in the prefix cache,
    where its recomputation may find them); its sequences are PREEMPTED, and what its rows need to go on (their
    next tokens and sampling state) is parked in the batch (``BlockBatch.park``)."""
    rows = batch.rows_of(group)
    index = torch.tensor(rows, dtype=torch.long, device=batch.next_tokens.device)
    batch.park(group, batch.next_tokens.index_select(0, index), batch.sampling.select(rows))
    leaving = set(rows)
    keep = [r for r in range(batch.n) if r not in leaving]
    running, group.running = group.running, []  # the group leaves the batch's list; its candidates stay its own
    batch.keep(keep, None)
    group.running, group.status = running, Status.WAITING
    for seq in running:
        seq.status, seq.num_computed_tokens = Status.PREEMPTED, 0


def compute_chunks(
    batch: BlockBatch,
    jobs: list[tuple[ChunkedPrefill, list[int]]],
    with_rows: bool = True,
    guesses: list[list[int]] | None = None,
) -> torch.Tensor | None:
    """One flat forward for chunks of prompts being prefilled (each job with its next tokens), with every running
    row's next token (``with_rows``; their logits are returned; with ``guesses``, each row's guessed tokens too) or
    alone. Each job takes its chunk's numbers."""
    begun = time.perf_counter()
    logits, outs = batch.forward_with_chunks(
        [(job.table, chunk, job.done, job.logits_wanted(len(chunk))) for job, chunk in jobs], with_rows, guesses
    )
    seconds = time.perf_counter() - begun
    for (job, chunk), out in zip(jobs, outs):
        job.took(batch, out, len(chunk), seconds)
    return logits


def propose(batch: BlockBatch) -> list[list[int]] | None:
    """Each running row's guessed tokens for the next step (speculative decoding; row order), cut to the blocks
    the pool can hand out now (``fit_guesses``); None when the batch does not speculate (off, or rows of several
    PEFT adapters together)."""
    if batch.speculation is None or batch.adapter is MIXED or not batch.groups:
        return None
    guesses = batch.speculation.guesses(batch.groups)
    return None if guesses is None else batch.fit_guesses(guesses)


def decode_step(
    batch: BlockBatch, jobs: list[tuple[ChunkedPrefill, list[int]]] = (), guesses: list[list[int]] | None = None
) -> list[tuple[RequestGroup, list[TokenNumbers]]]:
    """One decode step of the whole batch; each group's events. Finished candidates leave the batch. ``jobs``:
    prompts being prefilled whose next chunks ride in the same forward (each job's ``remaining`` tells whether it
    is in). ``guesses`` (``propose``, for the batch's rows as they are now): each row's guessed tokens ride in the
    same forward and are checked (``verify_step``)."""
    groups = list(batch.groups)
    if guesses is not None and any(guesses):
        logits = compute_chunks(batch, jobs, guesses=guesses) if jobs else batch.forward(guesses)
        batch.runner.inject("sample")
        results, tokens = verify_step(batch, groups, logits, guesses)
    else:
        logits = compute_chunks(batch, jobs) if jobs else batch.forward()
        batch.runner.inject("sample")
        results, tokens = sample_step(groups, logits, batch.sampling)
    keep_rows, offset, out = [], 0, []
    for group, (events, keep) in zip(groups, results):
        keep_rows += [offset + r for r in keep]
        offset += group.rows
        group.select(keep)
        if not keep:
            group.status = Status.FINISHED
        out.append((group, events))
    batch.keep(keep_rows, tokens)
    return out


def drop(batch: BlockBatch, group: RequestGroup, candidates: set[int] | None = None) -> None:
    """Take a group's rows out of the batch: all of them (its client went away), or those of ``candidates``
    (the output side ended them: stop strings)."""
    keep_rows, offset = [], 0
    for g in batch.groups:
        for row, seq in enumerate(g.running):
            if g is not group or (candidates is not None and seq.index not in candidates):
                keep_rows.append(offset + row)
        offset += g.rows
    for seq in group.running:
        if candidates is None or seq.index in candidates:
            seq.finish("abort" if candidates is None else "stop")
    group.running = [seq for seq in group.running if seq.status is Status.RUNNING]
    if not group.running:
        group.status = Status.FINISHED
    batch.keep(keep_rows, None)


def drop_finished(batch: BlockBatch) -> bool:
    """Rows whose candidates the output side ended since the last step leave the batch; whether any did."""
    dropped = False
    for group in list(batch.groups):
        ended = group.take_finished()
        if ended and any(seq.index in ended for seq in group.running):
            drop(batch, group, ended)
            dropped = True
    return dropped
