"""Independent references for tests: what transformers and the tokenizer themselves produce."""

from __future__ import annotations

import pytest
import torch

from app.engine.speculative import Proposer


def ref_greedy(model, tok, prompt_ids, max_new):
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new,
        do_sample=False,
        pad_token_id=tok.eos_token_id,
    )
    return out[0].tolist()


def pool_attention(q, keys, values, table, lo, hi, scale):
    """One query (Hq, D) over positions [lo, hi) of the block-pool rows ``table`` names (keys, values: (slots, Hkv,
    D)), in float64: the attention kernels' reference."""
    from app.engine.blocks import BLOCK

    slots = (table.view(-1, 1) * BLOCK + torch.arange(BLOCK)).view(-1)[lo:hi]
    k, v = keys[slots].double(), values[slots].double()
    group = q.shape[0] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for h in range(q.shape[0]):
        if hi > lo:
            weights = torch.softmax((q[h].double() @ k[:, h // group].T) * scale, -1)
            out[h] = weights @ v[:, h // group]
    return out


def ref_logprobs(model, ids):
    """A plain forward's log-softmax over ``ids`` (on the model's device; the result on the CPU)."""
    device = model.get_input_embeddings().weight.device
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=device)).logits[0].float()
    return torch.log_softmax(logits, dim=-1).cpu()


def continuation(tok, prompt_ids, all_ids):
    """The text after the prompt as ``decode(prompt + completion)`` reads it, step by step: each new token's
    text is what a full decode adds in length (byte-fallback decoders may rewrite a stray byte run into
    U+FFFD per byte; released text is never taken back, the new ids are then read alone). Equals
    ``decode(all)[len(decode(prompt)):]`` whenever the decodes grow monotonically, which is asserted to be the
    usual case."""
    text = ""
    previous = tok.decode(prompt_ids, skip_special_tokens=True)
    released = len(prompt_ids)
    for k in range(len(prompt_ids) + 1, len(all_ids) + 1):
        current = tok.decode(all_ids[:k], skip_special_tokens=True)
        if current.endswith("\ufffd") and k < len(all_ids):
            continue  # an incomplete character: wait for the bytes that complete it
        if current.startswith(previous):
            text += current[len(previous) :]
        else:  # a stray byte re-read earlier bytes: the new ids read alone
            text += tok.decode(all_ids[released:k], skip_special_tokens=True)
        previous, released = current, k
    full = tok.decode(all_ids, skip_special_tokens=True)
    head = tok.decode(prompt_ids, skip_special_tokens=True)
    if full.startswith(head + text[:-1]):
        assert text == full[len(head) :]
    return text


def check_reference(result, model, tok, ids, params, tol: float = 1e-4):
    """An answer against the model loaded by transformers: each chosen token's logprob (and top logprobs) equals a
    plain forward's log-softmax at its position, and a greedy pick is that forward's argmax (a tie aside)."""
    for choice in result.choices:
        chosen = choice.token_ids
        if not chosen:
            continue
        lp = ref_logprobs(model, ids + chosen)[len(ids) - 1 : len(ids) - 1 + len(chosen)]
        if choice.logprobs is not None:
            got = choice.logprobs.token_logprobs[-len(chosen) :]
            assert got == pytest.approx([lp[i, t].item() for i, t in enumerate(chosen)], abs=tol)
            k = params.logprobs or 0
            for i, top in enumerate(choice.logprobs.top_logprobs[-len(chosen) :]):
                if top and k:  # the k best, and the chosen token when it is not among them
                    want = torch.topk(lp[i], k).values.tolist()
                    assert sorted(top.values(), reverse=True)[:k] == pytest.approx(want, abs=tol)
        plain = params.temperature == 0.0 and not (params.logit_bias or params.repetition_penalty != 1.0)
        if plain and not (params.presence_penalty or params.frequency_penalty or params.constraint):
            best = lp.max(dim=-1).values
            assert all(lp[i, t].item() >= best[i].item() - tol for i, t in enumerate(chosen)), "not the argmax"


class Oracle(Proposer):
    """A speculative proposer for tests that guesses from known answers: ``answers`` maps a prompt (tuple) to the
    tokens that follow it; ``wrong`` shifts every guess to a token the answer does not have there."""

    def __init__(self, answers: dict[tuple, list[int]], vocab: int, wrong: bool = False):
        self.answers, self.vocab, self.wrong = answers, vocab, wrong

    def guess(self, state, tokens, k):
        for prompt, answer in self.answers.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                made = len(tokens) - len(prompt)
                guess = answer[made : made + k]
                return [(t + 1) % self.vocab for t in guess] if self.wrong else guess
        return []
