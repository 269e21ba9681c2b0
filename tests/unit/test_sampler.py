"""Unit tests of the batch-wide sampler (app/engine/sampling/sampler.py), without a model: each pass of ``shape_scores``
against a hand-computed result, which passes a batch turns on, the counter-based draws (seeds reproduce, a row's
draws depend on its own seed, step and scores only, not on the batch), ``select``/``cat`` keeping each row's
history, and the raw logprobs ``sample`` reports."""

from __future__ import annotations

import math

import pytest
import torch

from app.engine.params import SamplingParams
from app.engine.sampling.sampler import (
    RowSpec,
    SamplingRows,
    StepNumbers,
    choose,
    sample,
    sequence_seed,
    shape_scores,
    uniforms,
)

NEG_INF = float("-inf")
PASSES = ("bias", "suppress", "repetition", "presence", "temperature", "top_k", "top_p", "log_min_p")


# ============================================================================================ helpers ===
def probs_to_logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in row] for row in rows], dtype=torch.float32)


def kept(scores: torch.Tensor) -> list[list[int]]:
    return [[i for i, v in enumerate(row) if v != NEG_INF] for row in scores.tolist()]


def spec(suppress=(), wants_logprob=False, **kw) -> RowSpec:
    return RowSpec.of(SamplingParams(**kw), tuple(suppress), wants_logprob)


def rows_for(n: int, vocab: int, *, prompt=(), suppress=(), wants_logprob=False, seeds=None, **kw) -> SamplingRows:
    """``n`` candidates of one prompt with these ``SamplingParams``, seeded as the engine seeds them."""
    if seeds is None:
        base = kw.get("seed")
        seeds = [sequence_seed(base if base is not None else 0, i) for i in range(n)]
    return SamplingRows.for_prompt(spec(suppress, wants_logprob, **kw), list(seeds), list(prompt), vocab, "cpu")


def shaped(logits: torch.Tensor, **kw) -> torch.Tensor:
    """One step's scores for rows that all asked for ``kw`` (one row per row of ``logits``)."""
    return shape_scores(logits, rows_for(logits.shape[0], logits.shape[1], **kw))


def draws(rows: SamplingRows, logits: torch.Tensor, steps: int) -> list[list[int]]:
    """``steps`` tokens per row; ``sample`` records each step, so every step uses the next counter."""
    return [sample(logits, rows)[0].tolist() for _ in range(steps)]


def active(rows: SamplingRows) -> set[str]:
    return {name for name in PASSES if getattr(rows, name) is not None}


# ============================================================================================ passes ===
class TestPasses:
    @pytest.mark.parametrize(
        "p,expected",
        [
            (0.0, [0]),  # only the top token
            (0.4, [0]),  # 0.5 alone reaches 0.4
            (0.75, [0, 1]),  # 0.5 + 0.3 = 0.8 >= 0.75
            (0.85, [0, 1, 2]),  # 0.95 >= 0.85
            (0.99, [0, 1, 2, 3]),
        ],
    )
    def test_top_p_keeps_smallest_set_reaching_p(self, p, expected):
        logits = probs_to_logits([0.5, 0.3, 0.15, 0.05])
        assert kept(shaped(logits, top_p=p)) == [expected]

    def test_top_p_unsorted_rows_and_kept_values(self):
        logits = probs_to_logits([0.05, 0.15, 0.3, 0.5], [0.3, 0.05, 0.5, 0.15])
        out = shaped(logits, top_p=0.75)
        assert kept(out) == [[2, 3], [0, 2]]
        finite = out != NEG_INF
        assert torch.equal(out[finite], logits[finite])  # kept logits are untouched

    def test_top_p_always_keeps_the_top_token(self):
        logits = probs_to_logits([0.97, 0.01, 0.01, 0.01])
        assert kept(shaped(logits, top_p=0.5)) == [[0]]
        # tokens tied with the last one kept all stay (thresholds on values: no order among equal tokens by id)
        assert kept(shaped(probs_to_logits([0.25] * 4), top_p=0.0)) == [[0, 1, 2, 3]]
        assert kept(shaped(probs_to_logits([0.4, 0.2, 0.2, 0.2]), top_p=0.5)) == [[0, 1, 2, 3]]
        assert kept(shaped(probs_to_logits([0.4, 0.3, 0.2, 0.1]), top_p=0.5)) == [[0, 1]]

    @pytest.mark.parametrize(
        "k,expected", [(1, [1]), (2, [1, 2]), (3, [0, 1, 2]), (4, [0, 1, 2, 3]), (100, [0, 1, 2, 3])]
    )
    def test_top_k(self, k, expected):
        logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
        out = shaped(logits, top_k=k)
        assert kept(out) == [expected]
        assert out[0, 1].item() == 3.0

    def test_top_k_per_row(self):
        logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [5.0, -1.0, 0.0, 4.0]])
        assert kept(shaped(logits, top_k=2)) == [[1, 2], [0, 3]]

    @pytest.mark.parametrize("p,expected", [(0.5, [0, 1]), (0.2, [0, 1, 2]), (0.61, [0]), (0.0, [0, 1, 2, 3])])
    def test_min_p(self, p, expected):
        # threshold = p * max prob = p * 0.5; a token stays when its prob >= the threshold
        logits = probs_to_logits([0.5, 0.3, 0.15, 0.05])
        assert kept(shaped(logits, min_p=p)) == [expected]

    def test_min_p_scale_invariant(self):
        # the same distribution with a constant added to every logit keeps the same set
        logits = probs_to_logits([0.5, 0.3, 0.15, 0.05]) + 7.0
        assert kept(shaped(logits, min_p=0.5)) == [[0, 1]]

    def test_temperature(self):
        logits = torch.tensor([[1.0, -2.0, 0.5]])
        assert torch.allclose(shaped(logits, temperature=0.5), torch.tensor([[2.0, -4.0, 1.0]]))
        assert torch.allclose(shaped(logits, temperature=2.0), torch.tensor([[0.5, -1.0, 0.25]]))

    def test_repetition_penalty_over_prompt_and_generated(self):
        rows = rows_for(1, 5, prompt=[0, 1], repetition_penalty=2.0)
        logits = torch.tensor([[2.0, -1.0, 3.0, 0.5, -4.0]])
        assert shape_scores(logits, rows).tolist() == [[1.0, -2.0, 3.0, 0.5, -4.0]]  # prompt tokens 0 and 1
        rows.record(torch.tensor([3]))
        assert shape_scores(logits, rows).tolist() == [[1.0, -2.0, 3.0, 0.25, -4.0]]  # now token 3 too
        rows.record(torch.tensor([3]))  # repeats do not compound
        assert shape_scores(logits, rows).tolist() == [[1.0, -2.0, 3.0, 0.25, -4.0]]

    @staticmethod
    def generated(rows: SamplingRows) -> SamplingRows:
        for step in ([2, 0], [2, 0], [0, 3]):
            rows.record(torch.tensor(step))
        return rows

    def test_presence_frequency_penalty_counts_generated_only(self):
        # row 0 generated 2, 2, 0; row 1 generated 0, 0, 3; the prompt's token 1 is not counted
        rows = self.generated(rows_for(2, 4, prompt=[1], presence_penalty=0.5, frequency_penalty=0.1))
        logits = torch.zeros(2, 4)
        expected = torch.tensor(
            [[-(0.1 + 0.5), 0.0, -(2 * 0.1 + 0.5), 0.0], [-(2 * 0.1 + 0.5), 0.0, 0.0, -(0.1 + 0.5)]]
        )
        assert torch.allclose(shape_scores(logits, rows), expected)
        negative = self.generated(rows_for(2, 4, prompt=[1], presence_penalty=-1.0))
        assert shape_scores(logits, negative).tolist() == [[1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 1.0]]

    def test_select_keeps_each_rows_history(self):
        rows = rows_for(3, 4, prompt=[0], repetition_penalty=1.5, presence_penalty=0.5)
        rows.record(torch.tensor([1, 2, 3]))
        rows = rows.select([0, 2])
        assert rows.counts.tolist() == [[0, 1, 0, 0], [0, 0, 0, 1]]
        assert rows.seen.tolist() == [[True, True, False, False], [True, False, False, True]]
        assert rows.steps.tolist() == [1, 1]

    def test_logit_bias(self):
        logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0]])
        out = shaped(logits, logit_bias=((1, 5.0), (3, -100.0)))
        assert out.tolist() == [[0.0, 6.0, 2.0, -97.0], [1.0, 6.0, 1.0, -99.0]]

    def test_logit_bias_per_row(self):
        rows = SamplingRows([spec(logit_bias=((0, 2.0),)), spec(), spec(logit_bias=((3, -1.0),))], [1, 2, 3], 4, "cpu")
        assert shape_scores(torch.zeros(3, 4), rows).tolist() == [[2.0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, -1.0]]

    def test_suppress_tokens_before_min_tokens(self):
        rows = rows_for(1, 4, suppress=(2, 3), min_tokens=2)
        logits = torch.tensor([[0.0, 1.0, 5.0, 4.0]])
        for _ in (0, 1):
            assert shape_scores(logits, rows).tolist() == [[0.0, 1.0, NEG_INF, NEG_INF]]
            rows.record(torch.tensor([1]))
        assert shape_scores(logits, rows).tolist() == [[0.0, 1.0, 5.0, 4.0]]

    def test_suppression_follows_each_rows_own_count(self):
        late = rows_for(1, 4, suppress=(2,), min_tokens=1)
        late.record(torch.tensor([0]))  # this row has its one token already
        rows = SamplingRows.cat([late, rows_for(1, 4, suppress=(2,), min_tokens=1)])
        assert kept(shape_scores(torch.zeros(2, 4), rows)) == [[0, 1, 2, 3], [0, 1, 3]]

    def test_passes_compose_in_order(self):
        # bias, then temperature: the bias is scaled too
        assert shaped(torch.zeros(1, 4), logit_bias=((1, 2.0),), temperature=0.5).tolist() == [[0, 4.0, 0, 0]]
        # suppression before top-k: a suppressed token takes no top-k slot
        logits = torch.tensor([[5.0, 4.0, 3.0, 2.0]])
        assert kept(shaped(logits, suppress=(0,), min_tokens=1, top_k=2)) == [[1, 2]]
        # presence penalty, then temperature: the penalty is scaled too
        rows = rows_for(1, 4, presence_penalty=1.0, temperature=0.5)
        rows.record(torch.tensor([0]))
        assert shape_scores(torch.zeros(1, 4), rows).tolist() == [[-2.0, 0, 0, 0]]
        # top-k, then top-p over the renormalized rest: 4/7 alone reaches 0.5 (0.4 would not)
        assert kept(shaped(probs_to_logits([0.4, 0.3, 0.2, 0.1]), top_k=2, top_p=0.5)) == [[0]]
        # min-p after temperature: at T=2 the ratios are sqrt(0.6), sqrt(0.3), sqrt(0.1)
        assert kept(shaped(probs_to_logits([0.5, 0.3, 0.15, 0.05]), temperature=2.0, min_p=0.5)) == [[0, 1, 2]]


# ===================================================================================== active passes ===
class TestActivePasses:
    @pytest.mark.parametrize(
        "kw",
        [
            {},
            {"temperature": 0.0},
            {"temperature": 1.0, "top_p": 1.0, "top_k": 0},
            {"temperature": 0.0, "top_k": 5, "top_p": 0.5, "min_p": 0.1},
            {"temperature": 0.0, "seed": 3},
            {"min_tokens": 0},
            {"top_k": -1},
        ],
    )
    def test_plain_greedy_or_sampling_turns_no_pass_on(self, kw):
        rows = rows_for(2, 10, suppress=(2,), **kw)
        assert active(rows) == set()
        assert rows.counts is None and rows.seen is None and rows.greedy is None

    def test_temperature_alone(self):
        assert active(rows_for(1, 10, suppress=(2,), temperature=0.7, top_k=-1)) == {"temperature"}

    def test_everything(self):
        rows = rows_for(
            2,
            10,
            suppress=(2,),
            temperature=0.7,
            top_k=5,
            top_p=0.9,
            min_p=0.05,
            presence_penalty=0.1,
            frequency_penalty=0.2,
            repetition_penalty=1.2,
            logit_bias=((1, 1.0),),
            min_tokens=2,
        )
        assert active(rows) == set(PASSES)
        assert rows.counts is not None and rows.seen is not None

    def test_greedy_keeps_logit_shaping_but_no_filters(self):
        rows = rows_for(
            1,
            10,
            suppress=(2,),
            prompt=[4],
            temperature=0.0,
            top_k=5,
            top_p=0.5,
            min_p=0.2,
            logit_bias=((1, 1.0),),
            repetition_penalty=1.3,
            presence_penalty=0.5,
            min_tokens=1,
        )
        assert active(rows) == {"bias", "suppress", "repetition", "presence"}
        assert rows.greedy_all

    def test_min_tokens_without_ids_to_suppress(self):
        assert active(rows_for(1, 10, suppress=(), min_tokens=3)) == set()

    def test_greedy_is_argmax_of_shaped_scores(self):
        logits = torch.tensor([[3.0, 2.0, 2.5, 1.0, 0.0]])
        rows = rows_for(
            1,
            5,
            prompt=[0],
            temperature=0.0,
            logit_bias=((4, 1.8),),
            repetition_penalty=2.0,
            suppress=(2,),
            min_tokens=1,
        )
        # token 0: 3 / 2 = 1.5 (prompt); token 2: suppressed; token 4: 0 + 1.8 -> 1.8; token 1: 2.0
        assert sample(logits, rows)[0].tolist() == [1]
        # then token 1 is penalized too (1.0) and 2 is free (2.5)
        assert sample(logits, rows)[0].tolist() == [2]

    def test_mixed_greedy_and_sampled_rows(self):
        torch.manual_seed(0)
        logits = torch.randn(2, 30)
        greedy_kw = dict(temperature=0.0, logit_bias=((5, 4.0),), repetition_penalty=1.5, prompt=[1, 2])
        sampled_kw = dict(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05, seed=21)
        greedy_alone, sampled_alone = rows_for(1, 30, **greedy_kw), rows_for(1, 30, **sampled_kw)
        mixed = SamplingRows.cat([rows_for(1, 30, **greedy_kw), rows_for(1, 30, **sampled_kw)])
        assert mixed.greedy is not None and mixed.greedy.tolist() == [True, False]
        for _ in range(25):
            expected_greedy = shape_scores(logits[:1], greedy_alone).argmax(-1)
            scores = shape_scores(logits, mixed)
            assert torch.equal(scores[:1], shape_scores(logits[:1], greedy_alone))
            assert torch.equal(scores[1:], shape_scores(logits[1:], sampled_alone))
            tokens, _ = sample(logits, mixed)
            assert tokens[0].item() == expected_greedy.item()
            assert tokens[1].item() == sample(logits[1:], sampled_alone)[0].item()
            greedy_alone.record(tokens[:1])


# ========================================================================================= the draws ===
class TestDraws:
    LOGITS = torch.zeros(3, 50)  # uniform over 50 tokens: sequences of draws differ visibly

    def test_greedy_is_argmax(self):
        rows = rows_for(2, 3, temperature=0.0)
        logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
        assert choose(shape_scores(logits, rows), rows).tolist() == [1, 0]
        assert sample(logits, rows)[0].tolist() == [1, 0]

    def test_same_seed_reproduces(self):
        assert draws(rows_for(3, 50, seed=1234), self.LOGITS, 20) == draws(rows_for(3, 50, seed=1234), self.LOGITS, 20)

    def test_different_seeds_and_rows_differ(self):
        a = draws(rows_for(3, 50, seed=1), self.LOGITS, 20)
        b = draws(rows_for(3, 50, seed=2), self.LOGITS, 20)
        assert a != b
        rows = list(zip(*a))
        assert rows[0] != rows[1] != rows[2] and rows[0] != rows[2]

    def test_steps_differ(self):
        assert len(set(step[0] for step in draws(rows_for(1, 50, seed=3), self.LOGITS[:1], 20))) > 5

    def test_rows_do_not_depend_on_the_batch(self):
        alone = draws(rows_for(1, 50, seed=99), self.LOGITS[:1], 15)
        batched = draws(rows_for(3, 50, seed=99), self.LOGITS, 15)
        assert [step[:1] for step in batched] == alone

    def test_rows_do_not_depend_on_neighbours_with_other_parameters(self):
        torch.manual_seed(1)
        logits = torch.randn(4, 40)
        kw = dict(temperature=0.9, top_p=0.95, repetition_penalty=1.2, prompt=[3, 4], seed=42)
        alone = draws(rows_for(1, 40, **kw), logits[1:2], 30)
        batch = SamplingRows.cat(
            [
                rows_for(1, 40, temperature=0.0, seed=1),
                rows_for(1, 40, **kw),
                rows_for(
                    2, 40, temperature=1.7, top_k=3, min_p=0.1, presence_penalty=1.0, logit_bias=((0, 3.0),), seed=5
                ),
            ]
        )
        batched = draws(batch, logits, 30)
        assert [step[1] for step in batched] == [step[0] for step in alone]

    def test_selecting_rows_keeps_each_rows_stream(self):
        reference = draws(rows_for(3, 50, seed=7), self.LOGITS, 12)
        rows = rows_for(3, 50, seed=7)
        first = draws(rows, self.LOGITS, 5)
        rows = rows.select([0, 2])  # row 1 finished
        rest = draws(rows, self.LOGITS[:2], 7)
        assert first == reference[:5]
        assert rest == [[step[0], step[2]] for step in reference[5:]]

    def test_select_reorders_rows(self):
        rows = rows_for(2, 4, repetition_penalty=2.0, seeds=[10, 20])
        rows.record(torch.tensor([1, 3]))
        swapped = rows.select([1, 0])
        assert swapped.seed_list == [20, 10]
        assert swapped.seen[0].tolist() == [False, False, False, True]

    def test_masked_tokens_are_never_drawn(self):
        logits = torch.full((2, 20), NEG_INF)
        logits[0, 3] = 0.0
        logits[0, 7] = 0.0
        logits[1, 11] = 5.0
        picks = draws(rows_for(2, 20, seed=5), logits, 100)
        assert {p[0] for p in picks} == {3, 7} and {p[1] for p in picks} == {11}

    def test_filtered_tokens_are_never_drawn(self):
        logits = probs_to_logits([0.3, 0.25, 0.2, 0.15, 0.1])
        picks = draws(rows_for(1, 5, seed=8, top_k=2), logits, 300)
        assert {p[0] for p in picks} == {0, 1}
        picks = draws(rows_for(1, 5, seed=8, min_p=0.7), logits, 300)
        assert {p[0] for p in picks} == {0, 1}

    @pytest.mark.parametrize("how", ["steps", "seeds"])
    def test_draws_follow_the_distribution(self, how):
        probs = [0.7, 0.2, 0.1]
        logits = probs_to_logits(probs)
        if how == "steps":  # one row, 3000 steps (each recorded: the next counter)
            picks = [step[0] for step in draws(rows_for(1, 3, seed=11), logits, 3000)]
        else:  # 3000 rows with their own seeds, one step
            picks = draws(rows_for(3000, 3, seed=11), logits.expand(3000, 3), 1)[0]
        for token, p in enumerate(probs):
            assert abs(picks.count(token) / 3000 - p) < 0.04

    def test_temperature_changes_the_distribution(self):
        logits = probs_to_logits([0.7, 0.2, 0.1]).expand(3000, 3)
        picks = draws(rows_for(3000, 3, seed=12, temperature=0.5), logits, 1)[0]
        expected = [p * p / (0.49 + 0.04 + 0.01) for p in (0.7, 0.2, 0.1)]  # p^(1/T), renormalized
        for token, p in enumerate(expected):
            assert abs(picks.count(token) / 3000 - p) < 0.04


# =================================================================================== cat and history ===
class TestCat:
    @pytest.mark.parametrize("history_first", [True, False])
    def test_cat_of_rows_with_and_without_history(self, history_first):
        torch.manual_seed(2)
        vocab = 12
        logits = torch.randn(3, vocab)
        with_history = rows_for(
            2, vocab, prompt=[0, 1], repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.3, seed=3
        )
        without = rows_for(1, vocab, temperature=0.7, seed=4)
        with_history.record(torch.tensor([5, 6]))
        with_history.record(torch.tensor([5, 7]))
        without.record(torch.tensor([9]))
        parts = [with_history, without] if history_first else [without, with_history]
        split = [2, 1] if history_first else [1, 2]
        batch = SamplingRows.cat(parts)
        assert len(batch) == 3 and batch.counts is not None and batch.seen is not None
        for _ in range(10):
            chunks = logits[: split[0]], logits[split[0] :]
            expected = torch.cat([shape_scores(chunk, part) for chunk, part in zip(chunks, parts)])
            assert torch.equal(shape_scores(logits, batch), expected)
            tokens, _ = sample(logits, batch)
            alone = torch.cat([sample(chunk, part)[0] for chunk, part in zip(chunks, parts)])
            assert torch.equal(tokens, alone)

    def test_cat_keeps_steps_and_history(self):
        a = rows_for(1, 4, repetition_penalty=2.0, seeds=[1])
        a.record(torch.tensor([2]))
        b = rows_for(1, 4, seeds=[2])
        batch = SamplingRows.cat([a, b])
        assert batch.steps.tolist() == [1, 0]
        assert batch.seed_list == [1, 2]
        assert batch.seen.tolist() == [[False, False, True, False], [False] * 4]
        assert batch.counts is None

    def test_cat_skips_empty_parts(self):
        a = rows_for(2, 4, seed=1)
        assert SamplingRows.cat([a.select([]), a]) is a


# ==================================================================================== sample numbers ===
class TestSampleNumbers:
    def test_no_logprobs_wanted(self):
        rows = rows_for(2, 5, seed=1)
        tokens, numbers = sample(torch.zeros(2, 5), rows)
        assert isinstance(numbers, StepNumbers)
        assert numbers.tokens == tokens.tolist()
        assert numbers.logprobs is None and numbers.top_ids is None and numbers.top_values is None

    def test_raw_logprobs_of_the_chosen_token_and_top_k(self):
        logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0], [1.0, 0.5, 0.0, 2.0, -1.0]])
        # row 0: greedy with a bias that makes the least likely token win; row 1: sampled, 2 logprobs;
        # row 2: only the chosen token's logprob (best_of ranking), sampled at a high temperature
        rows = SamplingRows(
            [
                spec(temperature=0.0, logit_bias=((4, 100.0),), logprobs=2, wants_logprob=True),
                spec(temperature=0.5, top_k=2, logprobs=1, wants_logprob=True),
                spec(temperature=3.0, wants_logprob=True),
            ],
            [1, 2, 3],
            5,
            "cpu",
        )
        tokens, numbers = sample(logits, rows)
        raw = torch.log_softmax(logits, dim=-1)
        assert numbers.tokens == tokens.tolist()
        assert tokens[0].item() == 4 and tokens[1].item() in (3, 4)
        assert len(numbers.tokens) == len(numbers.logprobs) == len(numbers.top_ids) == len(numbers.top_values) == 3
        for row, token in enumerate(numbers.tokens):
            assert numbers.logprobs[row] == pytest.approx(raw[row, token].item(), abs=1e-6)
            top = torch.topk(raw[row], 2)
            assert numbers.top_ids[row] == top.indices.tolist()
            assert numbers.top_values[row] == pytest.approx(top.values.tolist(), abs=1e-6)
        assert numbers.logprobs[0] == pytest.approx(-math.log(sum(math.exp(v) for v in range(5))), abs=1e-6)
        assert numbers.top_ids[0] == [0, 1] and numbers.top_ids[1] == [4, 3]

    def test_chosen_logprob_without_top_k(self):
        logits = torch.tensor([[1.0, 2.0, 3.0]])
        tokens, numbers = sample(logits, rows_for(1, 3, seed=5, wants_logprob=True))
        assert numbers.top_ids is None and numbers.top_values is None
        assert numbers.logprobs[0] == pytest.approx(torch.log_softmax(logits, -1)[0, tokens[0]].item(), abs=1e-6)

    def test_sample_records_the_step(self):
        rows = rows_for(2, 5, repetition_penalty=2.0, presence_penalty=1.0, seed=1)
        tokens, _ = sample(torch.zeros(2, 5), rows)
        assert rows.steps.tolist() == [1, 1]
        assert rows.counts.sum(-1).tolist() == [1.0, 1.0]
        assert rows.seen[torch.arange(2), tokens].all()


# ================================================================================ uniforms and seeds ===
class TestUniforms:
    def test_in_open_interval_deterministic_and_roughly_uniform(self):
        seeds = torch.arange(10000, dtype=torch.long)
        steps = torch.zeros(10000, dtype=torch.long)
        u = uniforms(seeds, steps)
        assert u.dtype == torch.float64
        assert torch.equal(u, uniforms(seeds.clone(), steps.clone()))
        assert (u > 0).all() and (u < 1).all()
        assert abs(u.mean().item() - 0.5) < 0.02
        histogram = torch.histc(u, bins=10, min=0.0, max=1.0)
        assert (histogram - 1000).abs().max().item() < 150

    def test_roughly_uniform_over_steps_of_one_seed(self):
        u = uniforms(torch.full((10000,), 12345, dtype=torch.long), torch.arange(10000, dtype=torch.long))
        assert (u > 0).all() and (u < 1).all()
        assert abs(u.mean().item() - 0.5) < 0.02
        assert len(set(u.tolist())) == 10000

    def test_extreme_seeds_stay_in_range(self):
        seeds = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63)], dtype=torch.long)
        for step in (0, 1, 2**40):
            u = uniforms(seeds, torch.full_like(seeds, step))
            assert (u > 0).all() and (u < 1).all()

    def test_a_row_depends_on_its_own_seed_and_step_only(self):
        seeds = torch.tensor([5, 6, 7], dtype=torch.long)
        steps = torch.tensor([0, 3, 9], dtype=torch.long)
        together = uniforms(seeds, steps)
        for i in range(3):
            assert together[i].item() == uniforms(seeds[i : i + 1], steps[i : i + 1]).item()
        assert uniforms(seeds, steps + 1).tolist() != together.tolist()

    def test_sequence_seed(self):
        assert sequence_seed(7, 0) == sequence_seed(7, 0)
        seeds = [sequence_seed(7, i) for i in range(100)]
        assert len(set(seeds)) == 100 and all(0 <= s < 2**63 for s in seeds)
        assert sequence_seed(8, 0) != sequence_seed(7, 0)
        assert sequence_seed(None, 0) != sequence_seed(None, 0)  # unseeded: a random base each time


class TestAllowedTokensAndProcessedLogprobs:
    def test_only_allowed_tokens_are_chosen_greedy_and_sampled(self):
        logits = torch.tensor([[5.0, 1.0, 0.5, 3.0, 2.0]] * 2)
        greedy = rows_for(2, 5, temperature=0.0, allowed_token_ids=(1, 4))
        assert kept(shape_scores(logits, greedy)) == [[1, 4], [1, 4]]
        assert sample(logits, greedy)[0].tolist() == [4, 4]  # the argmax among the allowed
        sampled = rows_for(2, 5, temperature=1.0, seed=3, allowed_token_ids=(0, 2))
        picks = {t for step in draws(sampled, logits, 200) for t in step}
        assert picks == {0, 2}

    def test_a_row_without_the_restriction_is_unaffected(self):
        logits = torch.tensor([[5.0, 1.0, 0.5, 3.0, 2.0]])
        free = rows_for(1, 5, temperature=0.0)
        limited = rows_for(1, 5, temperature=0.0, allowed_token_ids=(1,))
        both = SamplingRows.cat([free, limited])
        assert sample(logits.repeat(2, 1), both)[0].tolist() == [0, 1]

    def test_processed_logprobs_are_those_of_the_sampled_distribution(self):
        logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0]])
        raw = rows_for(1, 5, wants_logprob=True, temperature=0.5, top_k=2, seed=1, logprobs=2)
        processed = rows_for(
            1, 5, wants_logprob=True, temperature=0.5, top_k=2, seed=1, logprobs=2, processed_logprobs=True
        )
        (token,), numbers = sample(logits, processed)
        expected = torch.log_softmax(torch.tensor([4.0, -math.inf, -math.inf, -math.inf, 6.0]), dim=-1)
        assert numbers.logprobs[0] == pytest.approx(expected[int(token)].item(), abs=1e-6)
        assert numbers.top_ids[0] == [4, 0]
        assert numbers.top_values[0] == pytest.approx([expected[4].item(), expected[0].item()], abs=1e-6)
        (token_raw,), raw_numbers = sample(logits, raw)
        assert token_raw == token  # the same draw; only the report differs
        assert raw_numbers.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[int(token)].item(), abs=1e-6)
