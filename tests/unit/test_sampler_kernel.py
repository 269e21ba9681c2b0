"""The CPU sampler kernel (``kernels/sampler.cpp``, called by ``sampler.sample`` for batches with sampled rows)
against the documented draw written apart from the engine (``references.processed_scores`` and ``counter_draw``:
float64, plain Python and PyTorch): every row's token, for temperature, top-k, top-p (nuclei inside and beyond the
kernel's first 64 candidates), min-p, ties at a cut, masked tokens and greedy rows beside sampled ones."""

from __future__ import annotations

import pytest
import torch

from app.engine.model import cpu_kernels
from app.engine.params import SamplingParams
from app.engine.sampling.sampler import RowSpec, SamplingRows, sample, sequence_seed
from references import candidate_seed, counter_draw, counter_uniform, processed_scores

pytestmark = pytest.mark.skipif(cpu_kernels.kernel() is None, reason="saker's CPU kernels are not built here")

VOCAB = 4096
STEPS = 6

CASES = {
    "temperature": dict(temperature=0.7),
    "hot": dict(temperature=1.9),
    "top_p, small nucleus": dict(temperature=0.8, top_p=0.9),
    "top_p, wide nucleus": dict(temperature=1.5, top_p=0.99),
    "top_k": dict(temperature=1.0, top_k=40),
    "top_k beyond 64, then top_p": dict(temperature=1.2, top_k=700, top_p=0.97),
    "top_k below the nucleus": dict(temperature=1.0, top_k=3, top_p=0.95),
    "min_p": dict(temperature=1.0, min_p=0.02),
    "all of them": dict(temperature=0.9, top_k=200, top_p=0.8, min_p=0.01),
    "allowed ids": dict(temperature=1.0, top_p=0.9, allowed_token_ids=(3, 17, 400, 401, 4000)),
}


def logits_of(rows: int, vocab: int, seed: int, peak: float) -> torch.Tensor:
    """Language-model-like rows: a few large scores over a broad tail (``peak`` sets how far they stand out)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * 2.0
    top = torch.randint(0, vocab, (rows, 8), generator=gen)
    x.scatter_add_(1, top, torch.rand(rows, 8, generator=gen) * peak)
    return x


def reference_tokens(logits: torch.Tensor, params: SamplingParams, step: int) -> list[int]:
    out = []
    for i, row in enumerate(logits):
        scores = processed_scores(row, params, [], [])
        out.append(counter_draw(scores, counter_uniform(candidate_seed(params.seed, i), step))[0])
    return out


def rows_of(params: SamplingParams, n: int, vocab: int) -> SamplingRows:
    spec = RowSpec.of(params, (), False)
    return SamplingRows.for_prompt(spec, [sequence_seed(params.seed, i) for i in range(n)], [], vocab, "cpu")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("peak", [4.0, 12.0])
def test_each_row_draws_what_the_reference_draws(case, peak):
    params = SamplingParams(seed=11, **CASES[case])
    logits = logits_of(12, VOCAB, seed=len(case), peak=peak)
    rows = rows_of(params, len(logits), VOCAB)
    for step in range(STEPS):
        tokens, numbers = sample(logits, rows)
        assert numbers.tokens == reference_tokens(logits, params, step), (case, step)


def test_ties_at_a_cut_all_stay():
    """Tokens whose score equals the last one top-k keeps stay too, whatever their ids: with 5 equal leaders and
    top_k 2, every draw is one of the five, and over many draws each of them comes up."""
    logits = torch.full((1, 64), -3.0)
    leaders = [5, 9, 30, 41, 63]
    logits[0, leaders] = 2.0
    params = SamplingParams(seed=3, temperature=1.0, top_k=2)
    rows = rows_of(params, 1, 64)
    seen = {sample(logits, rows)[1].tokens[0] for _ in range(200)}
    assert seen == set(leaders)


def test_greedy_rows_beside_sampled_ones_take_their_argmax():
    logits = logits_of(8, VOCAB, seed=5, peak=6.0)
    greedy = RowSpec.of(SamplingParams(temperature=0.0), (), False)
    sampled = RowSpec.of(SamplingParams(temperature=1.3, top_p=0.9, seed=2), (), False)
    specs = [greedy, sampled] * 4
    rows = SamplingRows(specs, [sequence_seed(2, i) for i in range(8)], VOCAB, "cpu")
    tokens = sample(logits, rows)[1].tokens
    assert tokens[0::2] == logits[0::2].argmax(-1).tolist()
    params = SamplingParams(temperature=1.3, top_p=0.9, seed=2)
    for i in range(1, 8, 2):
        scores = processed_scores(logits[i], params, [], [])
        assert tokens[i] == counter_draw(scores, counter_uniform(sequence_seed(2, i), 0))[0]


def test_a_row_draws_the_same_alone_and_in_any_batch():
    logits = logits_of(16, VOCAB, seed=9, peak=5.0)
    params = SamplingParams(seed=4, temperature=1.1, top_p=0.95)
    together = sample(logits, rows_of(params, 16, VOCAB))[1].tokens
    for i in (0, 7, 15):
        spec = RowSpec.of(params, (), False)
        alone = SamplingRows([spec], [sequence_seed(4, i)], VOCAB, "cpu")
        assert sample(logits[i : i + 1], alone)[1].tokens == [together[i]]


def test_the_embedded_vocabulary_size():
    """49,152 tokens (the embedded model's): a flat row's nucleus lies far beyond the first 64 candidates."""
    logits = logits_of(4, 49152, seed=1, peak=3.0)
    params = SamplingParams(seed=8, temperature=1.0, top_p=0.9)
    assert sample(logits, rows_of(params, 4, 49152))[1].tokens == reference_tokens(logits, params, 0)


def test_sampled_batches_go_through_the_kernel(monkeypatch):
    """On the CPU the choice of a batch with sampled rows is the kernel's (the test above would pass on the tensor
    operations too)."""
    calls = []
    real = cpu_kernels.sample_tokens
    monkeypatch.setattr(cpu_kernels, "sample_tokens", lambda *a: calls.append(1) or real(*a))
    params = SamplingParams(seed=1, temperature=0.9)
    sample(logits_of(2, 64, seed=0, peak=2.0), rows_of(params, 2, 64))
    assert calls == [1]


@pytest.mark.parametrize("vocab", [1, 7, 31, 33, 4096, 50257])
def test_greedy_rows_take_torchs_argmax_ties_infinities_and_nan_included(vocab):
    """``cpu_kernels.argmax_rows`` (what an all-greedy batch takes on the CPU) against ``torch.argmax``: the first
    index of each row's largest score, over vocabularies that are not whole vectors, rows with that score tied at
    several places (the first wins), a row masked to -inf, a row holding +inf and rows holding NaN (torch answers
    the first NaN)."""
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(12, vocab, generator=gen)
    x[1] = x[1].round()  # ties everywhere
    if vocab > 3:
        x[2, [vocab - 1, 2, vocab // 2]] = 9.0  # a tie for the top, its first place in the middle of a vector
        x[3, vocab - 1] = 50.0  # the largest in the tail after the last whole vector
    x[4] = -torch.inf
    x[5, vocab // 3] = torch.inf
    x[6, vocab - 1] = torch.nan
    x[7, [vocab // 2, 0]] = torch.nan
    x[8] = torch.nan
    assert torch.equal(cpu_kernels.argmax_rows(x), x.argmax(-1))
    for i in (0, 2, 7, 11):
        assert torch.equal(cpu_kernels.argmax_rows(x[i : i + 1]), x[i : i + 1].argmax(-1))


def test_an_all_greedy_batch_goes_through_the_kernel(monkeypatch):
    """On the CPU an all-greedy batch's choice is the kernel's argmax (the test above shows it is torch's)."""
    calls = []
    real = cpu_kernels.argmax_rows
    monkeypatch.setattr(cpu_kernels, "argmax_rows", lambda x: calls.append(1) or real(x))
    logits = logits_of(3, 64, seed=0, peak=2.0)
    tokens = sample(logits, rows_of(SamplingParams(temperature=0.0), 3, 64))[1].tokens
    assert calls == [1] and tokens == logits.argmax(-1).tolist()
