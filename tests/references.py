"""Independent references for tests: what transformers and the tokenizer themselves produce."""

from __future__ import annotations

import torch


def ref_greedy(model, tok, prompt_ids, max_new):
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new,
        do_sample=False,
        pad_token_id=tok.eos_token_id,
    )
    return out[0].tolist()


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
