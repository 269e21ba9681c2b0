"""Independent references for tests: what transformers and the tokenizer themselves produce."""

from __future__ import annotations

import math

import pytest
import torch

from app.engine.core.speculative import Proposer


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
    from app.engine.core.blocks import BLOCK

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


# -- seeded sampling, written apart from app/engine/sampling/sampler.py ------------------------------------------
# The sampler's documented draw (DESIGN.md, "counter-based draws"; app/engine/sampling/sampler.py's docstring):
# candidate ``i`` of a request with seed ``s`` has its own seed, and its ``t``-th token is the inverse-CDF pick of
# the uniform number splitmix64(seed_i, t) over the processed distribution. Here in plain Python integers and float64,
# over a plain forward's logits: no engine code.
_MASK = (1 << 64) - 1


def serve_alone_and_beside(worker) -> list[tuple]:
    """Through the engine: a greedy request alone, then a long prompt (in chunks, beside decoding rows) while a
    greedy and a seeded request decode (mixed steps, rows joining and leaving). Returns each request as ``(ids,
    params, output)``, the one alone first and the long prompt second (``check_served`` checks them)."""
    import threading
    import time

    from app.engine.params import SamplingParams

    tok = worker.tokenizer
    greedy = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True)
    long_prompt = tok("Once upon a time there was a little robot who lived by the sea and loved the sky").input_ids
    alone = tok("Hello there").input_ids
    [output], _ = worker.complete([alone], greedy, 256)
    background = [
        (tok("The capital of France is").input_ids, SamplingParams(max_tokens=30, temperature=0.0, logprobs=1)),
        (tok("Hi").input_ids, SamplingParams(max_tokens=6, temperature=0.8, seed=5, logprobs=1, ignore_eos=True)),
    ]
    results: dict[int, object] = {}

    def run(i, ids, params):
        results[i] = worker.complete([ids], params, 256)[0][0]

    threads = [threading.Thread(target=run, args=(i, ids, p)) for i, (ids, p) in enumerate(background)]
    for thread in threads:
        thread.start()
    try:
        while not worker.engine.batch.groups and any(thread.is_alive() for thread in threads):
            time.sleep(0.01)  # the others are decoding before the long prompt comes
        [chunked], _ = worker.complete([long_prompt], greedy, 256)
    finally:
        for thread in threads:
            thread.join()
    served = [(alone, greedy, output), (long_prompt, greedy, chunked)]
    return served + [(ids, params, results[i]) for i, (ids, params) in enumerate(background)]


def check_served(served: list[tuple], plain, tok, tol: float = 1e-4) -> None:
    """``serve_alone_and_beside``'s answers against the plain forward ``plain``: its argmax and log-softmax within
    ``tol`` (``check_reference``), the lone request's greedy tokens those of its ``generate()``; the long prompt
    long enough to be chunked."""
    for ids, params, output in served:
        check_reference(output, plain, tok, ids, params, tol)
    (alone, _, output), (long_prompt, _, _) = served[:2]
    assert len(long_prompt) > 16
    if tol <= 1e-4:  # a GPU's float32 may part from the CPU's at a near tie (``check_reference`` allows ties)
        want = ref_greedy(plain, tok, alone, 10)[len(alone) :]
        assert output.choices[0].token_ids[: len(want)] == want


def candidate_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index * 0x9E3779B1) % 2**63


def counter_uniform(seed: int, step: int) -> float:
    """splitmix64's finalizer over ``seed * golden + step * 0xD1B54A32D192ED03`` (mod 2**64); its top 52 bits as a
    number in (0, 1)."""
    z = (seed * 0x9E3779B97F4A7C15 + step * 0xD1B54A32D192ED03) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    z ^= z >> 31
    return ((z >> 12) + 0.5) / 2.0**52


def processed_scores(logits, params, prompt_ids, made, allowed=None) -> torch.Tensor:
    """One position's scores after a request's processing (float64; -inf where a token may not be chosen):
    ``allowed`` (a (V,) bool mask) and ``allowed_token_ids``, logit bias, repetition penalty (over the prompt and
    ``made``, the tokens made so far), presence and frequency penalties (over ``made``); for a sampled request then
    temperature, top-k, top-p (over what top-k kept) and min-p, ties at a cut all kept."""
    assert params.min_tokens == 0
    scores = logits.double().clone()
    vocab = scores.shape[0]
    if allowed is not None:
        scores[~allowed] = float("-inf")
    if params.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[list(params.allowed_token_ids)] = True
        scores[~keep] = float("-inf")
    for token, value in params.logit_bias:
        scores[token] += value
    if params.repetition_penalty != 1.0:
        for token in set(prompt_ids) | set(made):
            value = scores[token]
            scores[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token in set(made):
        scores[token] -= made.count(token) * params.frequency_penalty + params.presence_penalty
    if params.temperature == 0:
        return scores
    scores = scores / params.temperature
    ordered = torch.sort(scores, descending=True).values
    keep_count = vocab
    if params.top_k > 0:
        keep_count = min(params.top_k, vocab)
    if params.top_p < 1.0:
        probs = torch.softmax(ordered, -1)
        mass = float(probs[:keep_count].sum())
        above = 0.0
        nucleus = 0
        for p in probs.tolist():  # a token stays while the mass above it is under top_p of the kept mass
            if above >= params.top_p * mass:
                break
            nucleus += 1
            above += p
        keep_count = min(keep_count, max(nucleus, 1))
    scores[scores < ordered[keep_count - 1]] = float("-inf")
    if params.min_p > 0:
        scores[scores < scores.max() + math.log(params.min_p)] = float("-inf")
    return scores


def counter_draw(scores: torch.Tensor, u: float) -> tuple[int, torch.Tensor, float]:
    """The inverse-CDF pick of ``u`` over softmax(``scores``): the first token whose cumulative mass reaches ``u``
    times the total; also the CDF and the target (to tell a near tie)."""
    cdf = torch.cumsum(torch.softmax(scores, -1), 0)
    target = u * float(cdf[-1])
    return int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype))[0]), cdf, target


def ref_sampled(model, prompt_ids, params, index, max_new, *, allowed=None, follow=None, eos=None, tol=1e-4):
    """Candidate ``index`` of a seeded, sampled request, drawn as documented over the model's own forward, one
    plain whole-sequence forward per token (no engine); for a greedy request (temperature 0) the argmax of the
    processed scores instead.

    ``allowed(made)``: the (V,) bool mask of tokens allowed after ``made`` (a constraint, ``grammar_allowed``), or
    None; the answer ends, without an EOS, once ``allowed.complete``. ``eos``: a token that ends the answer (it is
    kept). ``follow``: another answer (the engine's): where its token differs from the draw only because the target
    lies within ``tol`` of the boundary between them (a near tie, float32 against float64; for greedy, scores
    within ``tol``), that token is taken, so one rounding does not part the two for the rest of the answer."""
    device = model.get_input_embeddings().weight.device
    greedy = params.temperature == 0
    assert greedy or params.seed is not None
    seed = None if greedy else candidate_seed(params.seed, index)
    made: list[int] = []
    for step in range(max_new):
        with torch.no_grad():
            logits = model(torch.tensor([list(prompt_ids) + made], device=device)).logits[0, -1].float().cpu()
        if allowed is not None and allowed.complete(made):
            break  # a whole output: it ends here, no EOS drawn
        mask = allowed(made) if allowed is not None else None
        scores = processed_scores(logits, params, prompt_ids, made, mask)
        if greedy:
            token = int(scores.argmax())
            if follow is not None and step < len(follow) and follow[step] != token:
                if scores[follow[step]] >= scores[token] - tol:
                    token = follow[step]
            made.append(token)
            if eos is not None and token == eos:
                break
            continue
        token, cdf, target = counter_draw(scores, counter_uniform(seed, step))
        if follow is not None and step < len(follow) and follow[step] != token:
            other = follow[step]
            low = float(cdf[other - 1]) if other else 0.0
            total = float(cdf[-1])
            if scores[other] > float("-inf") and low - tol * total <= target <= float(cdf[other]) + tol * total:
                token = other
        made.append(token)
        if eos is not None and token == eos:
            break
    return made


def grammar_allowed(tok, pattern: str, eos: int):
    """A regex constraint's masks from the grammar library itself (llguidance's own matcher over the tokenizer,
    not the engine's ``app/engine/sampling/grammar.py``): after ``made``, the tokens it allows next
    (``.complete(made)``:
    only the end may follow). llguidance allows only
    the canonical tokenization of text the pattern forces (after "red g" only "re", not "r"), so a mask read from
    the pattern alone would differ from any engine built on it."""
    import llguidance
    import llguidance.hf

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=[eos])
    grammar = llguidance.LLMatcher.grammar_from_regex(pattern)
    cache: dict[tuple, torch.Tensor] = {}

    def allowed(made: list[int]) -> torch.Tensor:
        key = tuple(made)
        if key not in cache:
            matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
            assert matcher.consume_tokens(list(made)), "the answer left the grammar"
            if matcher.is_stopped():
                mask = torch.zeros(len(tok), dtype=torch.bool)
                mask[eos] = True
            else:
                mask = torch.tensor(list(matcher.compute_logit_bias()), dtype=torch.uint8).bool()
            cache[key] = mask
        return cache[key]

    def complete(made: list[int]) -> bool:
        """Whether ``made`` is a whole output: nothing but the end may follow (an answer that ends there says
        ``stop``, whether or not it had room for the EOS)."""
        mask = allowed(made)
        return bool(mask[eos]) and int(mask.sum()) == 1

    allowed.complete = complete  # type: ignore[attr-defined]
    return allowed
