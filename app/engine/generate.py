"""Prefill + decode steps over a batch of sequences, yielding per-step events.

One prompt is prefilled once; its KV cache is expanded to the request's candidates (``n`` or ``best_of``),
then each decode step is one forward for every live sequence. Logprobs come from the logits of the forward
that picked the token; echo logprobs from the prefill's logits. Finished sequences leave the batch.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from app.engine.blocks import BLOCK
from app.engine.events import PromptEvent, PromptNumbers, TokenEvent, TokenNumbers
from app.engine.grammar import grammars_for
from app.engine.logprobs import raw_logprobs
from app.engine.params import SamplingParams, Timings
from app.engine.runner import MIXED, ModelRunner
from app.engine.sampler import RowSpec, SamplingRows, StepNumbers, sample, sequence_seed
from app.engine.stopping import StoppingCriteria
from app.engine.batches import (  # noqa: F401 - BUCKETS and bucket re-exported for the engine's users
    BUCKETS,
    BatchOutOfMemory,
    BlockBatch,
    bucket,
)


class Status(enum.Enum):
    """Where a group is: waiting in the scheduler's queue (new, or preempted: its sequences say so, the batch keeps
    its rows' sampling state), being computed by the steps (its prompt, or a preempted group's rows:
    ``ChunkedPrefill``), its rows in the running batch, or finished (every row ended, or the request failed or went
    away)."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


class SequenceStatus(enum.Enum):
    """Where one candidate is: waiting (its prompt not computed yet), running (a row of the batch), preempted (its
    blocks given back; computed again when its group comes back), finished (``Sequence.finish_reason`` says why)."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One candidate (``n``/``best_of``) of a prompt, plain data: its prompt (shared with the other candidates),
    the tokens it has made, how many of its positions are computed (their keys and values in its blocks: the
    batch's tables and lengths hold its row's, vLLM's persistent input batch), its seed, its status and why it
    finished."""

    index: int
    prompt_ids: list[int]
    seed: int | None = None
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # eos, stop_token, length, complete (the engine's); stop, abort (the output
    # side's stop string, the client gone)
    draft: object = None  # speculative decoding's state for it (``speculative.ProposerState``), made at its first guess

    def finish(self, reason: str) -> None:
        self.status, self.finish_reason = SequenceStatus.FINISHED, reason


class RequestGroup:
    """One prompt of one request, the handle of its candidates' ``Sequence``s (``n``/``best_of``; ``running``: those
    that are rows of the decode batch, in row order). The engine side only: ids, parameters, per-row sampling state
    and token-level stop rules; text is made by the output side (``output.RequestDecoder``), which may end a
    candidate early (a stop string) through ``finish_candidate``."""

    def __init__(
        self,
        runner: ModelRunner,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        max_length: int,
        timings: Timings | None = None,
        tag: int = 0,
    ):
        self.eos_token_ids = tuple(runner.eos_token_ids)  # the one fact of the model a group keeps
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.max_length = max_length
        self.timings = timings or Timings()
        self.tag = tag  # which prompt of its request this is
        self.want_logprobs = params.logprobs is not None
        self.want_candidate_logprob = self.want_logprobs or params.num_candidates > params.n
        self.k = params.logprobs or 0
        self.needs_prompt_logits = (params.echo and self.want_logprobs) or params.prompt_logprobs is not None
        # the prompt's top k: for echo's logprobs and for prompt_logprobs, whichever asks more
        self.prompt_k = max(self.k if params.echo else 0, params.prompt_logprobs or 0)
        self.max_new = params.max_tokens if params.max_tokens is not None else max_length - len(self.prompt_ids)
        self.seqs = [Sequence(i, self.prompt_ids, sequence_seed(params.seed, i)) for i in range(params.num_candidates)]
        self.running: list[Sequence] = []  # the candidates that are rows of the batch, in row order
        self.stopping = StoppingCriteria(
            eos_token_ids=frozenset(self.eos_token_ids),
            stop_token_ids=params.stop_token_ids,
            ignore_eos=params.ignore_eos,
            min_tokens=params.min_tokens,
            max_tokens=self.max_new,
            max_length=max_length,
        )
        self._prompt_lp: list[float] = []  # echo + logprobs: the prompt's numbers so far (score_prompt)
        self._prompt_top_ids: list[list[int]] = []
        self._prompt_top_values: list[list[float]] = []
        self._prompt_ranks: list[int] = []
        self.cancelled = False
        self.status = Status.WAITING
        self.arrival = 0  # its place in the order groups were submitted (the scheduler's)
        self.request_id = 0  # the request it is a prompt of (the engine's ``add_request``)
        self.eager = True  # its request's outputs go out every iteration (else when a prompt ends)
        self.tokens_made = 0  # tokens the engine sampled for this group (all rows)
        self._finish: list[int] = []  # candidates the output side ended (stop strings)
        self.grammars = None  # each candidate's grammar matcher (``make_grammars``)

    @property
    def rows(self) -> int:
        return len(self.running)

    @property
    def generates(self) -> bool:
        return self.max_new > 0

    @property
    def prefills(self) -> bool:
        """Whether admitting this group runs a forward (it generates, or its prompt is scored)."""
        return self.generates or self.needs_prompt_logits

    @property
    def blocks_now(self) -> int:
        """Blocks admitting this group takes (or is sure to soon): its prompt's, a copy of the partial last block for
        each other candidate, and one to grow into per row; for a preempted group, its rows' and one each."""
        if self.preempted:
            return sum(-(-length // BLOCK) + 1 for length in self.resumed_lengths)
        count, length = self.params.num_candidates, len(self.prompt_ids)
        return -(-length // BLOCK) + (count - 1) * (length % BLOCK > 0) + count

    @property
    def preempted(self) -> bool:
        """Its rows left the batch for older requests' blocks (``preempt``) and wait to be computed again."""
        return any(seq.status is SequenceStatus.PREEMPTED for seq in self.running)

    @property
    def resumed_lengths(self) -> list[int]:
        """A preempted group's rows: the positions each one held (its prompt and every token but its next one)."""
        return [len(seq.prompt_ids) + len(seq.output_ids) - 1 for seq in self.running]

    def finish_candidate(self, index: int) -> None:
        """The output side ended candidate ``index`` (a stop string): its row leaves at the next step. Called
        from the request's thread; the list append is atomic."""
        self._finish.append(index)

    def take_finished(self) -> set[int]:
        """Candidates ended by the output side since the last call (the model thread's side)."""
        if not self._finish:
            return set()
        taken, self._finish = self._finish, []
        return set(taken)

    # -- prompt -----------------------------------------------------------------------------------------
    def score_prompt(self, logits: torch.Tensor, start: int) -> None:
        """Echo + logprobs, prompt_logprobs: the numbers of the prompt tokens that rows ``start..`` of the prefill's
        logits (n, V) predict (row ``i`` predicts token ``i + 1``), kept on the host; the logits can go. A long
        prompt is scored chunk by chunk as it is prefilled, so no more than a chunk's logits are ever held."""
        count = min(logits.shape[0], len(self.prompt_ids) - 1 - start)
        if count <= 0:
            return
        k, ranked = self.prompt_k, self.params.prompt_logprobs is not None
        lp = raw_logprobs(logits[:count])
        ids = torch.tensor(self.prompt_ids[start + 1 : start + 1 + count], device=lp.device).view(-1, 1)
        chosen = lp.gather(-1, ids)
        parts = [chosen.double()]
        if ranked:
            parts.append(((lp > chosen).sum(-1, keepdim=True) + 1).double())
        if k:
            top = torch.topk(lp, k, dim=-1)
            parts += [top.values.double(), top.indices.double()]
        first = 2 if ranked else 1
        for row in torch.cat(parts, dim=1).tolist():
            self._prompt_lp.append(row[0])
            if ranked:
                self._prompt_ranks.append(int(row[1]))
            if k:
                self._prompt_top_values.append(row[first : first + k])
                self._prompt_top_ids.append([int(i) for i in row[first + k :]])

    def prompt_numbers(self) -> PromptNumbers:
        """The prompt's numbers: with echo + logprobs or prompt_logprobs, each prompt token's raw logprob, rank and
        the top k (from ``score_prompt``)."""
        count = len(self.prompt_ids)
        if not self.needs_prompt_logits:
            return PromptNumbers(count)
        top = self.prompt_k > 0
        return PromptNumbers(
            count,
            self._prompt_lp,
            self._prompt_top_ids if top else None,
            self._prompt_top_values if top else None,
            self._prompt_ranks if self.params.prompt_logprobs is not None else None,
        )

    def make_grammars(self, runner: ModelRunner) -> None:
        """A constrained group's matchers, one per candidate, made by the thread that submits it
        (``Scheduler.add_request``): a copy of a large schema's matcher takes milliseconds (12.9 ms for bench part S's
        2 kB schema), which every running row would wait for if the model thread made it when the group joins."""
        constraint = self.params.constraint
        if constraint is not None and self.grammars is None:
            compiled = grammars_for(runner.tokenizer, runner.vocab_size, tuple(runner.eos_token_ids))
            self.grammars = [compiled.row(constraint) for _ in range(self.params.num_candidates)]

    # -- decoding ---------------------------------------------------------------------------------------
    def begin(self, device, vocab: int) -> SamplingRows:
        """Set up the candidates (after the prefill): one row each, with its own seed."""
        params = self.params
        self.running = list(self.seqs)
        for seq in self.running:
            seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, len(self.prompt_ids)
        eos = () if params.ignore_eos else self.eos_token_ids
        suppress = tuple(sorted(set(params.stop_token_ids) | set(eos)))
        spec = RowSpec.of(params, suppress, self.want_candidate_logprob)
        seeds = [seq.seed for seq in self.running]
        return SamplingRows.for_prompt(spec, seeds, self.prompt_ids, vocab, device, self.grammars)

    def settle(
        self, numbers: StepNumbers, offset: int, runs: list[list[int]] | None = None
    ) -> tuple[list[TokenNumbers], list[int]]:
        """Host side of a step for this group's rows (``offset`` is where they start in the step): token-level
        stop rules and the numbers to hand out. ``runs`` (speculative decoding): each row's tokens, as indices into
        ``numbers``, in order (its row's own token, then the guesses it kept); a row that ends drops the rest. Returns
        the events and the rows (indices into this group's rows) that go on."""
        events, keep, tokens = [], [], numbers.tokens
        k, prompt_len, stopping = self.k, len(self.prompt_ids), self.stopping
        want_lp = numbers.logprobs is not None and self.want_candidate_logprob
        complete = numbers.complete
        for row, seq in enumerate(self.running):
            for at in runs[row] if runs is not None else (offset + row,):
                token_id = tokens[at]
                seq.output_ids.append(token_id)
                generated = len(seq.output_ids)
                seq.num_computed_tokens = prompt_len + generated - 1  # the new token is computed by the next step
                ended = stopping.ended_by(token_id, generated, prompt_len + generated, at in complete)
                events.append(
                    TokenNumbers(
                        seq.index,
                        token_id,
                        numbers.logprobs[at] if want_lp else None,
                        numbers.top_ids[at][:k] if k and self.want_logprobs else None,
                        numbers.top_values[at][:k] if k and self.want_logprobs else None,
                        ended,
                    )
                )
                if ended is not None:
                    break
            if ended is None:
                keep.append(row)
            else:
                seq.finish(ended)
        self.tokens_made += len(events)
        return events, keep

    def select(self, keep: list[int]) -> None:
        """Only the rows ``keep`` (indices into ``running``) stay in the batch."""
        if len(keep) != len(self.running):
            self.running = [self.running[i] for i in keep]


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
        seq.status, seq.num_computed_tokens = SequenceStatus.PREEMPTED, 0


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
        self.ids_of = (
            [(seq.prompt_ids + seq.output_ids)[:-1] for seq in group.running] if group.preempted else [group.prompt_ids]
        )
        self.tables: list[list[int]] = []  # each sequence's blocks (reserved at ``start``)
        self.spare: list[int] = []  # blocks for the other candidates' copies of the prompt's partial last block
        self.keys_of: list[list] = []  # the chained keys of each one's full blocks (prefix caching)
        self.cached: list[int] = []  # each one's positions from the prefix cache
        self.row = 0  # the sequence being computed
        self.done = 0  # its tokens computed (or cached)
        self.last: torch.Tensor | None = None  # the last prompt position's logits (1, 1, V)
        self.spent = 0.0  # seconds of steps that carried its chunks

    @property
    def ids(self) -> list[int]:
        return self.ids_of[self.row]

    @property
    def table(self) -> list[int]:
        return self.tables[self.row]

    def start(self, batch: BlockBatch) -> None:
        """Reserve the blocks of its sequences, their leading ones from the prefix cache when a kept prompt shares
        them (not when every position's logits are asked for: those of cached positions are not kept)."""
        group = self.group
        salt = batch.runner.prefix_salt(group.params.adapter)
        reuse = group.preempted or not group.needs_prompt_logits
        group.status = Status.PREFILLING
        for ids in self.ids_of:
            table, keys, cached = batch.reserve(ids, salt, reuse=reuse)
            self.tables.append(table)
            self.keys_of.append(keys)
            self.cached.append(cached)
        self.done = self.cached[0]
        if not group.preempted:
            group.timings.cached_tokens += self.done
            self.spare = batch.spare_blocks(group)

    @property
    def remaining(self) -> int:
        later = zip(self.ids_of[self.row + 1 :], self.cached[self.row + 1 :])
        return len(self.ids) - self.done + sum(len(s) - c for s, c in later)

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
        self.done += count
        self.spent += seconds
        if self.done < len(self.ids):
            return False
        if self.row + 1 < len(self.ids_of):
            self.row += 1
            self.done = self.cached[self.row]
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
        tables = self.tables
        group = self.group
        if not group.preempted:
            start = time.perf_counter() - self.spent
            events = _join(batch, group, self.last, start, tables[0], self._chain(0), self.spare)
            self.tables, self.spare = [], []
            return events
        chains = [self._chain(row) for row in range(len(tables))]
        lengths = group.resumed_lengths
        tokens, sampling = batch.unpark(group)
        group.status = Status.RUNNING
        for seq, length in zip(group.running, lengths):
            seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, length
        self.tables = []
        batch.add_rows(group, tables, lengths, chains, tokens, sampling, prompts=len(tables))
        group.timings.prefill_s += self.spent
        return []

    def abandon(self, batch: BlockBatch) -> None:
        """The request left or failed before its prompt was in: its blocks are let go."""
        spare, self.spare = self.spare, []
        for table in self.tables:
            batch.unreserve(table, spare)
            spare = []
        batch.blocks.release(spare)
        self.tables = []


def _join(
    batch: BlockBatch,
    group: RequestGroup,
    logits: torch.Tensor,
    start: float,
    table: list[int],
    chain: int = 0,
    spare: list[int] = (),
) -> list[Event]:
    """After a group's prompt was computed into the blocks ``table`` (its last position's logits (1, 1, V); ``chain``:
    the hash of its last full block's prefix-cache key; ``spare``: blocks for the other candidates' partial-block
    copies): the prompt's numbers, the first tokens, and the group in the batch if it goes on."""
    events: list[Event] = [group.prompt_numbers()]
    if not group.generates:
        group.timings.prefill_s += time.perf_counter() - start
        batch.unreserve(table, spare)
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
        group.status = Status.FINISHED
    group.timings.prefill_s += time.perf_counter() - start
    return events


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


def decode_step(
    batch: BlockBatch, jobs: list[tuple[ChunkedPrefill, list[int]]] = ()
) -> list[tuple[RequestGroup, list[TokenNumbers]]]:
    """One decode step of the whole batch; each group's events. Finished candidates leave the batch. ``jobs``:
    prompts being prefilled whose next chunks ride in the same forward (each job's ``remaining`` tells whether it
    is in). With speculative decoding the rows' guesses ride in it too (``verify_step``)."""
    guesses = None
    if batch.speculation is not None and batch.adapter is not MIXED:
        guesses = batch.speculation.guesses(batch.groups)
        if guesses is not None:
            guesses = batch.fit_guesses(guesses)
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
    group.running = [seq for seq in group.running if seq.status is SequenceStatus.RUNNING]
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
        from app.engine.output import RequestDecoder

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
