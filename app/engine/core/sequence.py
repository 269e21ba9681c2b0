"""A request's prompt and its candidates, plain data with a status: ``Sequence`` (one candidate: its tokens, how
many of its positions are computed, its seed) and ``RequestGroup`` (one prompt of one request: its candidates,
parameters, per-row sampling set-up and token-level stop rules; the engine side only: text is the output side's).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from app.engine.core.blocks import BLOCK
from app.engine.events import PromptNumbers, TokenNumbers
from app.engine.sampling.grammar import grammars_for
from app.engine.sampling.logprobs import raw_logprobs
from app.engine.params import SamplingParams, Timings
from app.engine.model.runner import ModelRunner
from app.engine.sampling.sampler import RowSpec, SamplingRows, StepNumbers, sequence_seed
from app.engine.output.stopping import StoppingCriteria


class Status(enum.Enum):
    """Where a group or one of its candidates is: waiting in the scheduler's queue (new; a preempted group waits
    too, the batch keeping its rows' sampling state), being computed by the steps (a group's prompt, or a
    preempted group's rows: ``ChunkedPrefill``), a row of the running batch, preempted (a candidate whose blocks
    were given back: computed again when its group comes back), or finished (every row ended, or the request
    failed or went away; a candidate's ``finish_reason`` says why)."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One candidate (``n``/``best_of``) of a prompt, plain data: its prompt (shared with the other candidates),
    the tokens it has made, how many of its positions are computed (``num_computed_tokens``: the one record of its
    progress, while its prompt is prefilled and while it decodes) and the blocks that hold their keys and values
    (``block_table``), its seed, its status and why it finished. While it is a row of the batch, the batch's arrays
    mirror its table and length for the step's inputs (vLLM's persistent input batch; ``BlockBatch.mirror_problem``
    checks them)."""

    index: int
    prompt_ids: list[int]
    seed: int | None = None
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)  # its blocks, in order (none while it holds none)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # eos, stop_token, length, complete (the engine's); stop, abort (the output
    # side's stop string, the client gone)
    draft: object = None  # speculative decoding's state for it (``speculative.ProposerState``), made at its first guess

    def finish(self, reason: str) -> None:
        self.status, self.finish_reason = Status.FINISHED, reason


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
        return any(seq.status is Status.PREEMPTED for seq in self.running)

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
        (``EngineCore.add_request``): a copy of a large schema's matcher takes milliseconds (12.9 ms for bench part S's
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
            seq.status, seq.num_computed_tokens = Status.RUNNING, len(self.prompt_ids)
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
