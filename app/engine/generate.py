"""Prefill + decode steps over a batch of sequences, yielding per-step events.

One prompt is prefilled once; its KV cache is expanded to the request's candidates (``n`` or ``best_of``),
then each decode step is one forward for every live sequence. Logprobs come from the logits of the forward
that picked the token; echo logprobs from the prefill's logits. Finished sequences leave the batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from app.engine.events import PromptEvent, PromptNumbers, TokenEvent, TokenNumbers
from app.engine.grammar import grammars_for
from app.engine.kv_cache import SlotStore, mergeable
from app.engine.logprobs import raw_logprobs
from app.engine.params import SamplingParams, Timings
from app.engine.runner import MIXED, ModelRunner
from app.engine.sampler import RowSpec, SamplingRows, StepNumbers, sample, sequence_seed
from app.engine.stopping import StoppingCriteria


@dataclass
class Candidate:
    """One row of a group on the engine side: which candidate it is and how many tokens it has."""

    index: int
    generated: int = 0


class RequestGroup:
    """One prompt of one request: its candidates (``n``/``best_of``) as rows of a decode batch. The engine side
    only: ids, parameters, per-row sampling state and token-level stop rules; text is made by the output side
    (``output.RequestDecoder``), which may end a candidate early (a stop string) through ``finish_candidate``."""

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
        self.runner = runner
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
        self.seqs: list[Candidate] = []
        self.stopping = StoppingCriteria(
            eos_token_ids=frozenset(runner.eos_token_ids),
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
        self.tokens_made = 0  # tokens the engine sampled for this group (all rows)
        self._finish: list[int] = []  # candidates the output side ended (stop strings)

    @property
    def rows(self) -> int:
        return len(self.seqs)

    @property
    def generates(self) -> bool:
        return self.max_new > 0

    @property
    def prefills(self) -> bool:
        """Whether admitting this group runs a forward (it generates, or its prompt is scored)."""
        return self.generates or self.needs_prompt_logits

    @property
    def reach(self) -> int:
        """The longest a row of this group can get: prompt + max new tokens (positions of its slot)."""
        return len(self.prompt_ids) + max(self.max_new, 0)

    @property
    def budget_tokens(self) -> int:
        """KV tokens this group may hold at most: what the batch token budget counts."""
        return self.reach * self.params.num_candidates

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

    # -- decoding ---------------------------------------------------------------------------------------
    def begin(self, device, vocab: int) -> SamplingRows:
        """Set up the candidates (after the prefill): one row each, with its own seed."""
        params = self.params
        count = params.num_candidates
        self.seqs = [Candidate(i) for i in range(count)]
        eos = () if params.ignore_eos else tuple(self.runner.eos_token_ids)
        suppress = tuple(sorted(set(params.stop_token_ids) | set(eos)))
        spec = RowSpec.of(params, suppress, self.want_candidate_logprob)
        seeds = [sequence_seed(params.seed, i) for i in range(count)]
        grammars = None
        if params.constraint is not None:
            compiled = grammars_for(self.runner.tokenizer, vocab, tuple(self.runner.eos_token_ids))
            grammars = [compiled.row(params.constraint) for _ in range(count)]
        return SamplingRows.for_prompt(spec, seeds, self.prompt_ids, vocab, device, grammars)

    def settle(self, numbers: StepNumbers, offset: int) -> tuple[list[TokenNumbers], list[int]]:
        """Host side of a step for this group's rows (``offset`` is where they start in the step): token-level
        stop rules and the numbers to hand out. Returns the events and the rows (indices into this group's
        rows) that go on."""
        events, keep, tokens = [], [], numbers.tokens
        k, prompt_len, stopping = self.k, len(self.prompt_ids), self.stopping
        want_lp = numbers.logprobs is not None and self.want_candidate_logprob
        complete = numbers.complete
        for row, seq in enumerate(self.seqs):
            at = offset + row
            token_id = tokens[at]
            seq.generated += 1
            done = at in complete
            ends = done or stopping.ends(token_id, seq.generated, prompt_len + seq.generated)
            events.append(
                TokenNumbers(
                    seq.index,
                    token_id,
                    numbers.logprobs[at] if want_lp else None,
                    numbers.top_ids[at][:k] if k and self.want_logprobs else None,
                    numbers.top_values[at][:k] if k and self.want_logprobs else None,
                    ends,
                    done,
                )
            )
            if not ends:
                keep.append(row)
        self.tokens_made += len(events)
        return events, keep

    def select(self, keep: list[int]) -> None:
        if len(keep) != len(self.seqs):
            self.seqs = [self.seqs[i] for i in keep]


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


Event = PromptNumbers | TokenNumbers


def new_batch(runner: ModelRunner, kv_cache_tokens: int | None = None) -> "SlotBatch | PaddedBatch":
    """A slot batch where the model's cache layers are plain (their rows can be written into slots), else a
    left-padded one."""
    return SlotBatch(runner, kv_cache_tokens) if runner.prefills_together else PaddedBatch(runner)


class BatchOutOfMemory(Exception):
    """A decode forward of a batch of several groups ran out of memory. The batch was rewound to how it was
    before the step (each layer's cache back to its length, the mask without the new column), so the step can
    be retried once a group has left. ``error`` is the original ``torch.OutOfMemoryError``."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class BatchBase:
    """What both kinds of running batch share: their groups (rows in group order) and the adapters in use."""

    runner: ModelRunner
    groups: list[RequestGroup]

    @property
    def rows(self) -> int:
        return sum(g.rows for g in self.groups)

    @property
    def adapters(self) -> set[str | None]:
        return {g.params.adapter for g in self.groups}

    @property
    def adapter(self) -> object:
        """The PEFT adapter every row uses (None: the base model), or ``MIXED``."""
        if not self.runner.adapters:
            return None
        adapters = self.adapters
        return (adapters.pop() if adapters else None) if len(adapters) <= 1 else MIXED


class SlotBatch(BatchBase):
    """The running batch over a ``SlotStore``: each candidate row owns a slot of preallocated keys and values.

    A group joins after its prefill (its prompt's keys and values are written into its rows' slots) and leaves
    when its last candidate finishes (the slots are free at once); no other row's data moves. A step feeds every
    slot in ``[0, high)`` its next token at its own position, with a mask built from per-slot lengths (free slots
    in between run along and are ignored), then takes the active rows' logits in row order."""

    joinable = True

    def __init__(self, runner: ModelRunner, kv_cache_tokens: int | None = None):
        self.runner = runner
        self.groups: list[RequestGroup] = []
        self.store = SlotStore(kv_cache_tokens)
        self.slot_of: list[int] = []  # slot of each row, in row order
        self.lengths_host: list[int] = []  # tokens each row has in its slot (row order)
        self._slot_index: torch.Tensor | None = None
        self._in_order = False  # rows sit in slots 0..n-1 in order (logits need no gather)
        self.lengths: torch.Tensor | None = None  # per slot: tokens in the slot (= position fed next)
        self.next_tokens: torch.Tensor | None = None  # per slot: the token fed next
        self.sampling: SamplingRows | None = None  # every row's sampling parameters and history

    @property
    def cache(self):
        return self.store.cache

    def accepts(self, group: RequestGroup) -> bool:
        return not self.groups or self.runner.can_join(self.adapters, group.params.adapter)

    def _per_slot(self, device) -> None:
        """Per-slot tensors as long as the store's slots (grown with it)."""
        size = self.store.wanted
        if self.lengths is None or self.lengths.shape[0] < size:
            lengths = torch.zeros(size, dtype=torch.long, device=device)
            tokens = torch.zeros(size, dtype=torch.long, device=device)
            if self.lengths is not None:
                lengths[: self.lengths.shape[0]] = self.lengths
                tokens[: self.next_tokens.shape[0]] = self.next_tokens
            self.lengths, self.next_tokens = lengths, tokens

    def add(self, group: RequestGroup, cache, tokens: torch.Tensor, sampling: SamplingRows) -> None:
        """Join a prefilled group: its cache (one row, or one per candidate), its candidates' first tokens,
        their sampling state."""
        slots = self.store.allocate(group.rows)
        length = self.store.write(slots, cache.layers, live=max(self.lengths_host, default=0) + 1)
        self._per_slot(tokens.device)
        index = torch.tensor(slots, dtype=torch.long, device=tokens.device)
        self.lengths[index] = length
        self.next_tokens[index] = tokens
        self.groups.append(group)
        self.slot_of += slots
        self.lengths_host += [length] * group.rows
        self._slot_index = None
        self.sampling = sampling if self.sampling is None else SamplingRows.cat([self.sampling, sampling])

    @property
    def slot_index(self) -> torch.Tensor:
        if self._slot_index is None:
            self._slot_index = torch.tensor(self.slot_of, dtype=torch.long, device=self.lengths.device)
            self._in_order = self.slot_of == list(range(len(self.slot_of)))
        return self._slot_index

    def keep(self, keep_rows: list[int], tokens: torch.Tensor | None) -> None:
        """After a step: the rows' next tokens (row order), then only ``keep_rows`` stay; the others' slots are
        free."""
        if tokens is not None and self.slot_of:
            self.next_tokens[self.slot_index] = tokens
        self.groups = [g for g in self.groups if g.rows]
        if len(keep_rows) == len(self.slot_of):
            return
        kept = set(keep_rows)
        gone = [slot for row, slot in enumerate(self.slot_of) if row not in kept]
        self.store.release(gone)
        if not keep_rows and self.runner.compiled_step is None:
            # idle: the storage goes back (a compiled step keeps it: its graphs hold the addresses)
            self.store.reset()
            self.lengths = self.next_tokens = None
            self.slot_of, self.lengths_host, self._slot_index, self.sampling = [], [], None, None
            return
        self.lengths[torch.tensor(gone, dtype=torch.long, device=self.lengths.device)] = 0
        self.slot_of = [self.slot_of[r] for r in keep_rows]
        self.lengths_host = [self.lengths_host[r] for r in keep_rows]
        self._slot_index = None
        self.sampling = self.sampling.select(keep_rows) if keep_rows else None

    def forward(self) -> torch.Tensor:
        """One decode step for every row; float32 logits (B, V) in row order. A forward that runs out of memory
        with several groups in the batch raises ``BatchOutOfMemory``: nothing moved (lengths advance only after
        a step), so the step can be retried once a group has left.

        Eager, the step runs over slots ``[0, high)`` with a window just past the longest row. Compiled
        (SAKER_COMPILE), it runs over a bucket of slots (free slots pad it) with the whole capacity as its
        window, so that each bucket is one graph whatever rows join and leave."""
        store, runner = self.store, self.runner
        longest = max(self.lengths_host) + 1
        mixed = self.adapter is MIXED
        compiled = runner.compiled_step if not mixed else None
        if compiled is not None:
            rows = bucket(store.high)
            store.ensure(longest, slots=rows)
            view = store.capacity
        else:
            rows = store.high
            store.ensure(longest)
            view = min(store.capacity, -(-longest // 16) * 16)
        self._per_slot(self.lengths.device)
        names = None
        if mixed:
            names = ["__base__"] * rows
            row = 0
            for group in self.groups:
                for _ in range(group.rows):
                    names[self.slot_of[row]] = group.params.adapter or "__base__"
                    row += 1
        try:
            forward = compiled or runner.slot_step
            logits = forward(
                self.next_tokens[:rows],
                self.lengths[:rows],
                store,
                view,
                **({"adapter_names": names} if names is not None else {}),
            )
        except torch.OutOfMemoryError as exc:
            if len(self.groups) < 2:
                raise
            raise BatchOutOfMemory(exc) from None
        index = self.slot_index
        self.lengths[index] += 1
        self.lengths_host = [n + 1 for n in self.lengths_host]
        if rows == len(self.slot_of) and self._in_order:
            return logits
        return logits.index_select(0, index)

    def warm_up(self, like, max_rows: int, length: int) -> None:
        """Compiled steps: storage for the largest bucket at ``length`` positions, then one step per bucket up
        to ``max_rows`` over free slots, so that no request pays a compile or a graph capture."""
        top = bucket(max_rows)
        self.store.ensure(length, like=[(layer.keys, layer.values) for layer in like.layers], slots=top)
        device = like.layers[0].keys.device
        for rows in BUCKETS + tuple(range(BUCKETS[-1] + 8, top + 1, 8)):
            if rows > top:
                break
            zeros = torch.zeros(rows, dtype=torch.long, device=device)
            self.runner.compiled_step(zeros, zeros.clone(), self.store, self.store.capacity)


BUCKETS = (1, 2, 4, 8, 16, 24, 32)


def bucket(rows: int) -> int:
    """Batch sizes a compiled step is captured for: 1, 2, 4, 8, 16, 24, 32, then multiples of 8."""
    for size in BUCKETS:
        if rows <= size:
            return size
    return -(-rows // 8) * 8


class PaddedBatch(BatchBase):
    """The running batch for models whose cache layers cannot be written per slot (sliding windows, static
    caches): one KV cache for the rows of several groups, left-padded to a common length.

    Each row keeps its own positions; an attention mask hides the padding. A group joins after its prefill
    and leaves when its last candidate finishes; one forward per step serves every row."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.groups: list[RequestGroup] = []
        self.cache = None
        self.mask: torch.Tensor | None = None  # (B, L) 1 = real token, 0 = padding; None: no padding
        self.positions: torch.Tensor | None = None  # (B,) position of the token fed next
        self.tokens: torch.Tensor | None = None  # (B,) token fed next
        self.sampling: SamplingRows | None = None  # every row's sampling parameters and history
        self.length = 0  # cached columns

    @property
    def joinable(self) -> bool:
        return mergeable(self.cache)

    def accepts(self, group: RequestGroup) -> bool:
        if not self.groups:
            return True
        return self.runner.can_join(self.adapters, group.params.adapter) and mergeable(self.cache)

    def add(self, group: RequestGroup, cache, tokens: torch.Tensor, sampling: SamplingRows) -> None:
        """Join a prefilled group: its cache (rows, prompt length), its first chosen tokens, its rows'
        sampling state."""
        if group.rows > 1 and cache.layers[0].keys.shape[0] == 1:
            cache.batch_repeat_interleave(group.rows)
        length = len(group.prompt_ids)
        device = tokens.device
        positions = torch.full((group.rows,), length, dtype=torch.long, device=device)
        if not self.groups:
            self.groups, self.cache, self.mask = [group], cache, None
            self.positions, self.tokens, self.length = positions, tokens, length
            self.sampling = sampling
            return
        self.sampling = SamplingRows.cat([self.sampling, sampling])
        new_len = max(self.length, length)
        old_mask = (
            self.mask if self.mask is not None else torch.ones(self.rows, self.length, dtype=torch.long, device=device)
        )
        grp_mask = torch.ones(group.rows, length, dtype=torch.long, device=device)
        for layer, new_layer in zip(self.cache.layers, cache.layers):
            layer.keys = torch.cat([_left_pad(layer.keys, new_len), _left_pad(new_layer.keys, new_len)])
            layer.values = torch.cat([_left_pad(layer.values, new_len), _left_pad(new_layer.values, new_len)])
        self.mask = torch.cat([_left_pad(old_mask, new_len, dim=1), _left_pad(grp_mask, new_len, dim=1)])
        self.positions = torch.cat([self.positions, positions])
        self.tokens = torch.cat([self.tokens, tokens])
        self.length = new_len
        self.groups.append(group)

    def keep(self, keep_rows: list[int], tokens: torch.Tensor | None) -> None:
        """After a step: keep these batch rows (their next tokens are ``tokens`` rows; None: as they are) and
        drop the rest."""
        if tokens is None:
            tokens = self.tokens
        self.groups = [g for g in self.groups if g.rows]
        if not keep_rows:
            self.groups, self.cache, self.mask, self.positions, self.tokens, self.length = [], None, None, None, None, 0
            self.sampling = None
            return
        if len(keep_rows) == tokens.shape[0]:
            self.tokens = tokens
            return
        self.sampling = self.sampling.select(keep_rows)
        index = torch.tensor(keep_rows, device=tokens.device)
        self.tokens = tokens.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        self.cache.batch_select_indices(index)
        if self.mask is not None:
            self.mask = self.mask.index_select(0, index)
            self._trim()

    def _trim(self) -> None:
        """Drop leading columns that are padding in every row (a long prompt left the batch)."""
        leading = int((self.mask.cumsum(1) == 0).sum(1).min())
        if leading:
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, leading:]
                layer.values = layer.values[:, :, leading:]
            self.mask = self.mask[:, leading:]
            self.length -= leading
        if bool(self.mask.all()):
            self.mask = None

    def forward(self) -> torch.Tensor:
        """One decode step for every row; float32 logits (B, V). Raises ``BatchOutOfMemory`` (the batch as
        before the step) when the forward of a batch of several mergeable groups runs out of memory."""
        length_before, mask_before = self.length, self.mask
        mask = None
        if self.mask is not None:
            self.mask = torch.cat(
                [self.mask, torch.ones(self.rows, 1, dtype=self.mask.dtype, device=self.mask.device)], dim=1
            )
            mask = self.mask
        row_adapters = None
        if self.adapter is MIXED:
            row_adapters = [g.params.adapter for g in self.groups for _ in range(g.rows)]
        try:
            logits = self.runner.decode(
                self.tokens, self.cache, attention_mask=mask, position_ids=self.positions, row_adapters=row_adapters
            )
        except torch.OutOfMemoryError as exc:
            if len(self.groups) < 2 or not mergeable(self.cache):
                raise
            self._rewind(length_before, mask_before)
            raise BatchOutOfMemory(exc) from None
        self.positions = self.positions + 1
        self.length += 1
        return logits

    def _rewind(self, length: int, mask: torch.Tensor | None) -> None:
        """Undo a failed step: layers that appended the step's token go back to ``length`` columns (views of
        the same buffers), and the mask loses the column the step added."""
        self.mask = mask
        for layer in self.cache.layers:
            if layer.keys.shape[-2] > length:
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]


def _left_pad(tensor: torch.Tensor, length: int, dim: int = -2) -> torch.Tensor:
    missing = length - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([torch.zeros(shape, dtype=tensor.dtype, device=tensor.device), tensor], dim=dim)


def admit(batch: SlotBatch | PaddedBatch, group: RequestGroup) -> list[Event]:
    """Prefill a group, sample its first tokens from the prefill's logits and, if it goes on, add it to the
    batch. Returns its events so far: the prompt's, then its first tokens'."""
    start = time.perf_counter()
    if not group.prefills:
        return [group.prompt_numbers()]
    logits, cache, reused = group.runner.prefill(group.prompt_ids, all_logits=group.needs_prompt_logits)
    group.timings.cached_tokens += reused
    return _join(batch, group, logits, cache, start)


def admit_together(batch: SlotBatch | PaddedBatch, groups: list[RequestGroup]) -> list[list[Event] | BaseException]:
    """``admit`` for several groups (each of which ``prefills``) with one prefill forward over their prompts,
    left-padded to a common length; each group then goes on with its own row of the logits and of the cache
    (padding cut off), as if prefilled alone. Per group its events, or the exception that failed it after the
    forward. A failed forward raises (no group has joined the batch then)."""
    start = time.perf_counter()
    runner = groups[0].runner
    all_logits = any(g.needs_prompt_logits for g in groups)
    logits, caches = runner.prefill_together([g.prompt_ids for g in groups], all_logits=all_logits)
    out: list[list[Event] | BaseException] = []
    for group, row_logits, cache in zip(groups, logits, caches):
        if not group.needs_prompt_logits:
            row_logits = row_logits[-1:]
        try:
            out.append(_join(batch, group, row_logits.unsqueeze(0), cache, start))
        except Exception as exc:
            out.append(exc)
    return out


class ChunkedPrefill:
    """A long prompt prefilled ``chunk`` tokens at a time, one chunk per scheduler iteration, so that the
    running batch's decode steps go on in between. The cache and the logits are those of one prefill (the
    same positions, to float rounding); ``finish`` then joins the group to the batch as ``admit`` does."""

    def __init__(self, group: RequestGroup, chunk: int):
        self.group, self.chunk = group, max(1, chunk)
        self.cache = None
        self.done = 0  # prompt tokens in the cache
        self.last: torch.Tensor | None = None  # the last prompt position's logits (1, 1, V)
        self.spent = 0.0  # seconds of forwards so far

    def advance(self) -> bool:
        """Forward the next chunk; True once the whole prompt is in."""
        start = time.perf_counter()
        group, runner = self.group, self.group.runner
        prompt, all_logits = group.prompt_ids, group.needs_prompt_logits
        if self.cache is None:
            self.cache, self.done = runner.open_prefill(prompt, all_logits)
            group.timings.cached_tokens += self.done
        end = min(self.done + self.chunk, len(prompt))
        logits = runner.extend(self.cache, prompt[self.done : end], all_logits)
        if all_logits:  # scored now; only the last position's logits are kept
            group.score_prompt(logits[0], self.done)
        self.last = logits[:, -1:, :]
        self.done = end
        self.spent += time.perf_counter() - start
        return end == len(prompt)

    def finish(self, batch: SlotBatch | PaddedBatch) -> list[Event]:
        group = self.group
        group.runner.remember(group.prompt_ids, self.cache)
        return _join(batch, group, self.last, self.cache, time.perf_counter() - self.spent)


def _join(
    batch: SlotBatch | PaddedBatch, group: RequestGroup, logits: torch.Tensor, cache, start: float
) -> list[Event]:
    """After a group's prefill (logits (1, L or 1, V), its cache): the prompt's numbers, the first tokens, and
    the group in the batch if it goes on."""
    if group.needs_prompt_logits and logits.shape[1] > 1:
        group.score_prompt(logits[0], 0)
    events: list[Event] = [group.prompt_numbers()]
    if not group.generates:
        group.timings.prefill_s += time.perf_counter() - start
        return events
    last = logits[:, -1, :].float()
    count = group.params.num_candidates
    sampling = group.begin(last.device, last.shape[-1])
    if count > 1:
        last = last.expand(count, last.shape[-1])
    [(first, keep)], tokens = sample_step([group], last, sampling)
    events += first
    group.select(keep)
    if keep:
        if len(keep) < count:
            tokens = tokens.index_select(0, torch.tensor(keep, device=tokens.device))
            sampling = sampling.select(keep)
        batch.add(group, cache, tokens, sampling)  # the prompt's one cache row serves every candidate
    group.timings.prefill_s += time.perf_counter() - start
    return events


def decode_step(batch: SlotBatch | PaddedBatch) -> list[tuple[RequestGroup, list[TokenNumbers]]]:
    """One decode step of the whole batch; each group's events. Finished candidates leave the batch."""
    logits = batch.forward()
    groups = list(batch.groups)
    results, tokens = sample_step(groups, logits, batch.sampling)
    keep_rows, offset, out = [], 0, []
    for group, (events, keep) in zip(groups, results):
        keep_rows += [offset + r for r in keep]
        offset += group.rows
        group.select(keep)
        out.append((group, events))
    batch.keep(keep_rows, tokens)
    return out


def drop(batch: SlotBatch | PaddedBatch, group: RequestGroup, candidates: set[int] | None = None) -> None:
    """Take a group's rows out of the batch: all of them (its client went away), or those of ``candidates``
    (the output side ended them: stop strings)."""
    keep_rows, offset = [], 0
    for g in batch.groups:
        for row, seq in enumerate(g.seqs):
            if g is not group or (candidates is not None and seq.index not in candidates):
                keep_rows.append(offset + row)
        offset += g.rows
    group.seqs = [] if candidates is None else [seq for seq in group.seqs if seq.index not in candidates]
    batch.keep(keep_rows, None)


def drop_finished(batch: SlotBatch | PaddedBatch) -> bool:
    """Rows whose candidates the output side ended since the last step leave the batch; whether any did."""
    dropped = False
    for group in list(batch.groups):
        ended = group.take_finished()
        if ended and any(seq.index in ended for seq in group.seqs):
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
        self.group = RequestGroup(runner, prompt_ids, params, max_length=max_length, timings=timings)

    def __iter__(self) -> Iterator[PromptEvent | TokenEvent]:
        from app.engine.output import RequestDecoder

        group = self.group
        decoder = RequestDecoder(group)
        with group.runner.adapter(group.params.adapter), torch.inference_mode():
            batch = new_batch(group.runner)
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
