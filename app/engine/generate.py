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
from app.engine.logprobs import candidate_keys, raw_logprobs
from app.engine.params import SamplingParams, Timings, TokenLogprobs
from app.engine.runner import ModelRunner
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


class Generator:
    """Runs one prompt through the model for ``params``; iterate it for events (prompt first)."""

    def __init__(self, runner: ModelRunner, prompt_ids: list[int], params: SamplingParams, *,
                 max_length: int, timings: Timings | None = None):
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.max_length = max_length
        self.timings = timings or Timings()
        self.want_logprobs = params.logprobs is not None
        self.want_candidate_logprob = self.want_logprobs or params.num_candidates > params.n

    # -- prompt -----------------------------------------------------------------------------------------
    def _prompt_event(self, logits: torch.Tensor | None) -> PromptEvent:
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
        if params.logprobs:
            top = torch.topk(lp[:-1], params.logprobs, dim=-1)
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
        pairs = sorted(zip(keys, cand_vals), key=lambda kv: -kv[1])
        return dict(pairs)

    # -- generation -------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[PromptEvent | TokenEvent]:
        params, runner = self.params, self.runner
        need_prompt_logits = params.echo and self.want_logprobs
        max_new = params.max_tokens if params.max_tokens is not None else self.max_length - len(self.prompt_ids)
        generate = max_new > 0
        if not generate and not need_prompt_logits:
            yield self._prompt_event(None)
            return

        start = time.perf_counter()
        with runner.adapter(params.adapter), torch.inference_mode():
            logits, cache = runner.prefill(self.prompt_ids, all_logits=need_prompt_logits)
            prompt_event = self._prompt_event(logits[0] if need_prompt_logits else None)
            self.timings.prefill_s = time.perf_counter() - start
            yield prompt_event
            if not generate:
                return
            yield from self._decode(logits[:, -1, :], cache, max_new)

    def _decode(self, last_logits: torch.Tensor, cache, max_new: int) -> Iterator[TokenEvent]:
        params, runner, tok = self.params, self.runner, self.tokenizer
        start = time.perf_counter()
        count = params.num_candidates
        device = last_logits.device
        vocab = last_logits.shape[-1]
        logits = last_logits.float().expand(count, vocab)
        if count > 1:
            cache.batch_repeat_interleave(count)

        stop_strings = StopStrings(params.stop, params.include_stop_str_in_output)
        eos = frozenset(runner.eos_token_ids)
        seqs = [SequenceState(i, IncrementalDetokenizer(tok, self.prompt_ids, params.skip_special_tokens),
                              StoppingCriteria(eos_token_ids=eos, stop_token_ids=params.stop_token_ids,
                                               stop_strings=stop_strings, ignore_eos=params.ignore_eos,
                                               min_tokens=params.min_tokens, max_tokens=max_new,
                                               max_length=self.max_length))
                for i in range(count)]
        suppress = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos)))
        processors = build_processors(params, vocab=vocab, suppress_ids=suppress, device=device)
        needs_counts, needs_seen = history_needs(params)
        history = TokenHistory(count, vocab, self.prompt_ids, device, counts=needs_counts, seen=needs_seen)
        chooser = TokenChooser(params, device, count)
        k = params.logprobs or 0
        try:
            yield from self._steps(logits, cache, seqs, processors, history, chooser, k)
        finally:
            self.timings.decode_s = time.perf_counter() - start

    def _steps(self, logits, cache, seqs, processors, history, chooser, k) -> Iterator[TokenEvent]:
        device = logits.device
        step = 0
        while seqs:
            scores = logits
            if processors:
                scores = logits.clone()
                for proc in processors:
                    scores = proc(scores, history, step)
            tokens = chooser(scores)
            chosen_lp = top_vals = top_ids = None
            if self.want_candidate_logprob:
                lp = raw_logprobs(logits)
                chosen_lp = lp.gather(-1, tokens.view(-1, 1)).squeeze(-1).tolist()
                if k:
                    top = torch.topk(lp, k, dim=-1)
                    top_vals, top_ids = top.values.tolist(), top.indices.tolist()
            token_list = tokens.tolist()
            history.add(tokens)
            step += 1

            keep: list[int] = []
            for row, seq in enumerate(seqs):
                token_id = token_list[row]
                top_dict = None
                if self.want_logprobs:
                    top_dict = self._top_dict(seq.detok, token_id, chosen_lp[row],
                                              top_ids[row] if k else [], top_vals[row] if k else [])
                seq.token_ids.append(token_id)
                piece = ""
                if seq.stopping.stop_token(token_id, len(seq.token_ids)):
                    piece = seq.detok.flush()       # bytes held before an EOS/stop token are final now
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
                event = TokenEvent(seq.index, token_id, piece,
                                   chosen_lp[row] if chosen_lp is not None else None, top_dict)
                if decision.stop:
                    event.finish_reason = decision.reason
                    event.text_end = decision.text_end
                else:
                    keep.append(row)
                yield event
            if len(keep) < len(seqs):
                if not keep:
                    break
                rows = torch.tensor(keep, device=device)
                seqs = [seqs[i] for i in keep]
                tokens = tokens.index_select(0, rows)
                cache.batch_select_indices(rows)
                history.select(rows)
                chooser.select(keep)
            logits = self.runner.decode(tokens, cache)
