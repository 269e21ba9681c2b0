"""Prefill + decode steps over a batch of sequences, yielding per-step events.

One prompt is prefilled once; its KV cache is expanded to the request's candidates (``n`` or ``best_of``),
then each decode step is one forward for every live sequence. Logprobs come from the logits of the forward
that picked the token; echo logprobs from the prefill's logits. Finished sequences leave the batch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from app.engine.detokenize import IncrementalDetokenizer
from app.engine.kv_cache import mergeable
from app.engine.logprobs import candidate_keys, raw_logprobs
from app.engine.params import SamplingParams, Timings, TokenLogprobs
from app.engine.runner import MIXED, ModelRunner
from app.engine.sampling import TokenChooser, TokenHistory, build_processors, history_needs
from app.engine.stopping import StopDecision, StoppingCriteria, StopStrings


@dataclass
class PromptEvent:
    """After the prefill: the prompt's text and, when asked, its token strings and logprobs."""
    prompt_tokens: int
    text: str
    logprobs: TokenLogprobs | None


@dataclass
class TokenEvent:
    """One generated token of candidate ``index``."""
    index: int
    token_id: int
    text: str                                # text this token completes (held-back characters excluded)
    logprob: float | None
    top_logprobs: dict[str, float] | None
    finish_reason: str | None = None         # set on the candidate's last token
    text_end: int | None = None              # where the candidate's text is cut (stop strings / tokens)


@dataclass
class SequenceState:
    index: int
    detok: IncrementalDetokenizer
    stopping: StoppingCriteria
    token_ids: list[int] = field(default_factory=list)
    text: str = ""


class RequestGroup:
    """One prompt of one request: its candidates (``n``/``best_of``) as rows of a decode batch, with their own
    processors, seeded generators, stop rules and detokenizers. Batches may hold several groups."""

    def __init__(self, runner: ModelRunner, prompt_ids: list[int], params: SamplingParams, *,
                 max_length: int, timings: Timings | None = None, tag: int = 0):
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.max_length = max_length
        self.timings = timings or Timings()
        self.tag = tag                              # which prompt of its request this is
        self.want_logprobs = params.logprobs is not None
        self.want_candidate_logprob = self.want_logprobs or params.num_candidates > params.n
        self.k = params.logprobs or 0
        self.needs_prompt_logits = params.echo and self.want_logprobs
        self.max_new = params.max_tokens if params.max_tokens is not None else max_length - len(self.prompt_ids)
        self.seqs: list[SequenceState] = []
        self.step = 0
        self.cancelled = False

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
    def budget_tokens(self) -> int:
        """KV tokens this group may hold at most: what the batch token budget counts."""
        return (len(self.prompt_ids) + max(self.max_new, 0)) * self.params.num_candidates

    # -- prompt -----------------------------------------------------------------------------------------
    def prompt_event(self, logits: torch.Tensor | None) -> PromptEvent:
        """The prompt's text and (with echo + logprobs) its logprobs from the prefill logits (L, V)."""
        params, tok = self.params, self.tokenizer
        if not params.echo:
            return PromptEvent(len(self.prompt_ids), "", None)
        if not self.want_logprobs:
            text = tok.decode(self.prompt_ids, skip_special_tokens=params.skip_special_tokens)
            return PromptEvent(len(self.prompt_ids), text, None)
        lp = raw_logprobs(logits)                                    # (L, V): row i predicts token i + 1
        ids = torch.tensor(self.prompt_ids[1:], device=lp.device)
        chosen = lp[:-1].gather(-1, ids.view(-1, 1)).squeeze(-1).tolist() if len(ids) else []
        top_vals = top_ids = None
        if self.k:
            top = torch.topk(lp[:-1], self.k, dim=-1)
            top_vals, top_ids = top.values.tolist(), top.indices.tolist()
        detok = IncrementalDetokenizer(tok, skip_special_tokens=params.skip_special_tokens)
        out = TokenLogprobs()
        text = ""
        for i, token_id in enumerate(self.prompt_ids):
            if i == 0:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                out.token_logprobs.append(chosen[i - 1])
                out.top_logprobs.append(self._top_dict(detok, token_id, chosen[i - 1],
                                                       top_ids[i - 1] if top_ids else [],
                                                       top_vals[i - 1] if top_vals else []))
            piece = detok.add(token_id)
            out.text_offset.append(len(text))
            out.tokens.append(piece)
            text += piece
        tail = detok.flush()
        if tail:
            out.tokens[-1] += tail
            text += tail
        return PromptEvent(len(self.prompt_ids), text, out)

    def _top_dict(self, detok, chosen_id: int, chosen_lp: float, ids: list[int], vals: list[float]):
        cand_ids = [chosen_id] + [i for i in ids if i != chosen_id]
        cand_vals = [chosen_lp] + [v for i, v in zip(ids, vals) if i != chosen_id]
        keys = candidate_keys(self.tokenizer, detok, cand_ids, self.runner.byte_level)
        return dict(sorted(zip(keys, cand_vals), key=lambda kv: -kv[1]))

    # -- decoding ---------------------------------------------------------------------------------------
    def begin(self, device, vocab: int) -> None:
        """Set up the candidates (after the prefill): stop rules, detokenizers, processors, generators."""
        params, tok = self.params, self.tokenizer
        count = params.num_candidates
        stop_strings = StopStrings(params.stop, params.include_stop_str_in_output)
        eos = frozenset(self.runner.eos_token_ids)
        self.seqs = [SequenceState(i, IncrementalDetokenizer(tok, self.prompt_ids, params.skip_special_tokens),
                                   StoppingCriteria(eos_token_ids=eos, stop_token_ids=params.stop_token_ids,
                                                    stop_strings=stop_strings, ignore_eos=params.ignore_eos,
                                                    min_tokens=params.min_tokens, max_tokens=self.max_new,
                                                    max_length=self.max_length))
                     for i in range(count)]
        suppress = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos)))
        self.processors = build_processors(params, vocab=vocab, suppress_ids=suppress, device=device)
        needs_counts, needs_seen = history_needs(params)
        self.history = TokenHistory(count, vocab, self.prompt_ids, device, counts=needs_counts, seen=needs_seen)
        self.chooser = TokenChooser(params, device, count)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """This group's next tokens from its rows of raw float32 logits (stays on the device)."""
        scores = logits
        if self.processors:
            scores = logits.clone()
            for proc in self.processors:
                scores = proc(scores, self.history, self.step)
        tokens = self.chooser(scores)
        self.history.add(tokens)
        self.step += 1
        return tokens

    def settle(self, tokens: list[int], chosen_lp: list[float] | None, top_ids: list[list[int]] | None,
               top_vals: list[list[float]] | None) -> tuple[list[TokenEvent], list[int]]:
        """Host side of a step: detokenize, check stops, build events. Returns the events and the rows
        (indices into this group's rows) that go on."""
        events, keep = [], []
        k = self.k
        for row, seq in enumerate(self.seqs):
            token_id = tokens[row]
            top_dict = None
            if self.want_logprobs:
                top_dict = self._top_dict(seq.detok, token_id, chosen_lp[row],
                                          top_ids[row][:k] if k else [], top_vals[row][:k] if k else [])
            seq.token_ids.append(token_id)
            piece = ""
            if seq.stopping.stop_token(token_id, len(seq.token_ids)):
                piece = seq.detok.flush()           # bytes held before an EOS/stop token are final now
                seq.text += piece
            before = len(seq.text)
            added = seq.detok.add(token_id)
            piece += added
            seq.text += added
            decision = seq.stopping(token_id, seq.text, before, len(seq.token_ids),
                                    len(self.prompt_ids) + len(seq.token_ids))
            if decision.stop and decision.text_end in (None, len(seq.text)):
                tail = seq.detok.flush()
                piece += tail
                seq.text += tail
                if decision.text_end is not None:
                    decision = StopDecision(True, decision.reason, len(seq.text))
            event = TokenEvent(seq.index, token_id, piece, chosen_lp[row] if chosen_lp is not None else None,
                               top_dict)
            if decision.stop:
                event.finish_reason = decision.reason
                event.text_end = decision.text_end
            else:
                keep.append(row)
            events.append(event)
        self.timings.generated_tokens += len(events)
        return events, keep

    def select(self, keep: list[int]) -> None:
        if len(keep) == len(self.seqs):
            return
        self.seqs = [self.seqs[i] for i in keep]
        if keep:
            rows = torch.tensor(keep, device=self.history.device)
            self.history.select(rows)
            self.chooser.select(keep)


def sample_step(groups: list[RequestGroup], logits: torch.Tensor
                ) -> tuple[list[tuple[list[TokenEvent], list[int]]], torch.Tensor]:
    """One step for groups whose rows are consecutive in ``logits`` (B, V): choose tokens per group, one
    transfer to the host, then events. Returns each group's (events, rows that go on) and the tokens (B,)."""
    chosen_parts, offset = [], 0
    for group in groups:
        chosen_parts.append(group.choose(logits[offset:offset + group.rows]))
        offset += group.rows
    tokens = chosen_parts[0] if len(chosen_parts) == 1 else torch.cat(chosen_parts)
    chosen_lp = top_vals = top_ids = None
    if any(g.want_candidate_logprob for g in groups):
        # tokens, chosen logprobs and the top k in one float64 tensor (exact for float32 values and token ids):
        # one transfer to the host for the whole step
        lp = raw_logprobs(logits)
        column = tokens.view(-1, 1)
        parts = [column, lp.gather(-1, column)]
        k = max((g.k for g in groups if g.want_logprobs), default=0)
        if k:
            top = torch.topk(lp, k, dim=-1)
            parts += [top.values, top.indices]
        rows = torch.cat([part.double() for part in parts], dim=1).tolist()
        token_list = [int(row[0]) for row in rows]
        chosen_lp = [row[1] for row in rows]
        if k:
            top_vals = [row[2:2 + k] for row in rows]
            top_ids = [[int(i) for i in row[2 + k:]] for row in rows]
    else:
        token_list = tokens.tolist()
    events, offset = [], 0
    for group in groups:
        sl = slice(offset, offset + group.rows)
        events.append(group.settle(token_list[sl], chosen_lp[sl] if chosen_lp else None,
                                   top_ids[sl] if top_ids else None, top_vals[sl] if top_vals else None))
        offset += group.rows
    return events, tokens


class BatchOutOfMemory(Exception):
    """A decode forward of a batch of several groups ran out of memory. The batch was rewound to how it was
    before the step (each layer's cache back to its length, the mask without the new column), so the step can
    be retried once a group has left. ``error`` is the original ``torch.OutOfMemoryError``."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class DecodeBatch:
    """The running batch: one KV cache for the rows of several groups, left-padded to a common length.

    Each row keeps its own positions; an attention mask hides the padding. A group joins after its prefill
    and leaves when its last candidate finishes; one forward per step serves every row."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.groups: list[RequestGroup] = []
        self.cache = None
        self.mask: torch.Tensor | None = None       # (B, L) 1 = real token, 0 = padding; None: no padding
        self.positions: torch.Tensor | None = None  # (B,) position of the token fed next
        self.tokens: torch.Tensor | None = None     # (B,) token fed next
        self.length = 0                             # cached columns

    @property
    def rows(self) -> int:
        return sum(g.rows for g in self.groups)

    @property
    def adapters(self) -> set[str | None]:
        return {g.params.adapter for g in self.groups}

    @property
    def adapter(self) -> object:
        """The PEFT adapter every row uses (None: the base model), or ``MIXED``."""
        adapters = self.adapters
        return (adapters.pop() if adapters else None) if len(adapters) <= 1 else MIXED

    def accepts(self, group: RequestGroup) -> bool:
        if not self.groups:
            return True
        return self.runner.can_join(self.adapters, group.params.adapter) and mergeable(self.cache)

    def add(self, group: RequestGroup, cache, tokens: torch.Tensor) -> None:
        """Join a prefilled group: its cache (rows, prompt length) and its first chosen tokens."""
        length = len(group.prompt_ids)
        device = tokens.device
        positions = torch.full((group.rows,), length, dtype=torch.long, device=device)
        if not self.groups:
            self.groups, self.cache, self.mask = [group], cache, None
            self.positions, self.tokens, self.length = positions, tokens, length
            return
        new_len = max(self.length, length)
        old_mask = self.mask if self.mask is not None else \
            torch.ones(self.rows, self.length, dtype=torch.long, device=device)
        grp_mask = torch.ones(group.rows, length, dtype=torch.long, device=device)
        for layer, new_layer in zip(self.cache.layers, cache.layers):
            layer.keys = torch.cat([_left_pad(layer.keys, new_len), _left_pad(new_layer.keys, new_len)])
            layer.values = torch.cat([_left_pad(layer.values, new_len), _left_pad(new_layer.values, new_len)])
        self.mask = torch.cat([_left_pad(old_mask, new_len, dim=1), _left_pad(grp_mask, new_len, dim=1)])
        self.positions = torch.cat([self.positions, positions])
        self.tokens = torch.cat([self.tokens, tokens])
        self.length = new_len
        self.groups.append(group)

    def keep(self, keep_rows: list[int], tokens: torch.Tensor) -> None:
        """After a step: keep these batch rows (their next tokens are ``tokens`` rows) and drop the rest."""
        self.groups = [g for g in self.groups if g.rows]
        if not keep_rows:
            self.groups, self.cache, self.mask, self.positions, self.tokens, self.length = [], None, None, None, None, 0
            return
        if len(keep_rows) == tokens.shape[0]:
            self.tokens = tokens
            return
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
            self.mask = torch.cat([self.mask, torch.ones(self.rows, 1, dtype=self.mask.dtype,
                                                         device=self.mask.device)], dim=1)
            mask = self.mask
        row_adapters = None
        if self.adapter is MIXED:
            row_adapters = [g.params.adapter for g in self.groups for _ in range(g.rows)]
        try:
            logits = self.runner.decode(self.tokens, self.cache, attention_mask=mask, position_ids=self.positions,
                                        row_adapters=row_adapters)
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


def admit(batch: DecodeBatch, group: RequestGroup) -> list[PromptEvent | TokenEvent]:
    """Prefill a group, sample its first tokens from the prefill's logits and, if it goes on, add it to the
    batch. Returns its events so far: the prompt's, then its first tokens'."""
    start = time.perf_counter()
    if not group.prefills:
        return [group.prompt_event(None)]
    static = group.runner.uses_static_cache(group.params.num_candidates, len(group.prompt_ids) + group.max_new)
    logits, cache, reused = group.runner.prefill(group.prompt_ids, all_logits=group.needs_prompt_logits,
                                                 static=static)
    group.timings.cached_tokens += reused
    return _join(batch, group, logits, cache, start)


def admit_together(batch: DecodeBatch, groups: list[RequestGroup]
                   ) -> list[list[PromptEvent | TokenEvent] | BaseException]:
    """``admit`` for several groups (each of which ``prefills``) with one prefill forward over their prompts,
    left-padded to a common length; each group then goes on with its own row of the logits and of the cache
    (padding cut off), as if prefilled alone. Per group its events, or the exception that failed it after the
    forward. A failed forward raises (no group has joined the batch then)."""
    start = time.perf_counter()
    runner = groups[0].runner
    all_logits = any(g.needs_prompt_logits for g in groups)
    logits, caches = runner.prefill_together([g.prompt_ids for g in groups], all_logits=all_logits)
    out: list[list[PromptEvent | TokenEvent] | BaseException] = []
    for group, row_logits, cache in zip(groups, logits, caches):
        if not group.needs_prompt_logits:
            row_logits = row_logits[-1:]
        try:
            out.append(_join(batch, group, row_logits.unsqueeze(0), cache, start))
        except Exception as exc:   # noqa: BLE001 - this group fails, the others go on
            out.append(exc)
    return out


class ChunkedPrefill:
    """A long prompt prefilled ``chunk`` tokens at a time, one chunk per scheduler iteration, so that the
    running batch's decode steps go on in between. The cache and the logits are those of one prefill (the
    same positions, to float rounding); ``finish`` then joins the group to the batch as ``admit`` does."""

    def __init__(self, group: RequestGroup, chunk: int):
        self.group, self.chunk = group, max(1, chunk)
        self.cache = None
        self.done = 0                       # prompt tokens in the cache
        self.parts: list[torch.Tensor] = []  # logits: every chunk's (echo scoring) or the last one's
        self.spent = 0.0                    # seconds of forwards so far

    def advance(self) -> bool:
        """Forward the next chunk; True once the whole prompt is in."""
        start = time.perf_counter()
        group, runner = self.group, self.group.runner
        prompt, all_logits = group.prompt_ids, group.needs_prompt_logits
        if self.cache is None:
            self.cache, self.done = runner.open_prefill(prompt, all_logits)
            group.timings.cached_tokens += self.done
        end = min(self.done + self.chunk, len(prompt))
        logits = runner.extend(self.cache, prompt[self.done:end], all_logits)
        if all_logits:
            self.parts.append(logits)
        else:
            self.parts = [logits]
        self.done = end
        self.spent += time.perf_counter() - start
        return end == len(prompt)

    def finish(self, batch: DecodeBatch) -> list[PromptEvent | TokenEvent]:
        group = self.group
        group.runner.remember(group.prompt_ids, self.cache)
        logits = torch.cat(self.parts, dim=1) if len(self.parts) > 1 else self.parts[0]
        return _join(batch, group, logits, self.cache, time.perf_counter() - self.spent)


def _join(batch: DecodeBatch, group: RequestGroup, logits: torch.Tensor, cache, start: float
          ) -> list[PromptEvent | TokenEvent]:
    """After a group's prefill (logits (1, L or 1, V), its cache): the prompt event, the first tokens, and the
    group in the batch if it goes on."""
    events: list[PromptEvent | TokenEvent] = [group.prompt_event(logits[0] if group.needs_prompt_logits else None)]
    if not group.generates:
        group.timings.prefill_s += time.perf_counter() - start
        return events
    last = logits[:, -1, :].float()
    count = group.params.num_candidates
    group.begin(last.device, last.shape[-1])
    if count > 1:
        cache.batch_repeat_interleave(count)
        last = last.expand(count, last.shape[-1])
    [(first, keep)], tokens = sample_step([group], last)
    events += first
    group.select(keep)
    if keep:
        if len(keep) < count:
            index = torch.tensor(keep, device=tokens.device)
            cache.batch_select_indices(index)
            tokens = tokens.index_select(0, index)
        batch.add(group, cache, tokens)
    group.timings.prefill_s += time.perf_counter() - start
    return events


def step(batch: DecodeBatch) -> list[tuple[RequestGroup, list[TokenEvent]]]:
    """One decode step of the whole batch; each group's events. Finished candidates leave the batch."""
    logits = batch.forward()
    groups = list(batch.groups)
    results, tokens = sample_step(groups, logits)
    keep_rows, offset, out = [], 0, []
    for group, (events, keep) in zip(groups, results):
        keep_rows += [offset + r for r in keep]
        offset += group.rows
        group.select(keep)
        out.append((group, events))
    batch.keep(keep_rows, tokens)
    return out


def drop(batch: DecodeBatch, group: RequestGroup) -> None:
    """Take a group out of the batch (its client went away)."""
    keep_rows, offset = [], 0
    for g in batch.groups:
        if g is not group:
            keep_rows += list(range(offset, offset + g.rows))
        offset += g.rows
    group.seqs = []
    batch.keep(keep_rows, batch.tokens)


class Generator:
    """One prompt run alone, start to end: the events of a single group (warm-up, tests and tools)."""

    def __init__(self, runner: ModelRunner, prompt_ids: list[int], params: SamplingParams, *,
                 max_length: int, timings: Timings | None = None):
        self.group = RequestGroup(runner, prompt_ids, params, max_length=max_length, timings=timings)

    def __iter__(self) -> Iterator[PromptEvent | TokenEvent]:
        group = self.group
        with group.runner.adapter(group.params.adapter), torch.inference_mode():
            batch = DecodeBatch(group.runner)
            yield from admit(batch, group)
            start = time.perf_counter()
            try:
                while batch.groups:
                    for _, events in step(batch):
                        yield from events
            finally:
                group.timings.decode_s += time.perf_counter() - start
