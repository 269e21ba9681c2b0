"""Speculative decoding (``SAKER_SPECULATIVE``) changes nothing but speed. Every engine test here names its oracle,
and each is independent of the engine (never the engine with speculation off):

- greedy answers: a plain loop of whole-sequence forwards of the model loaded by transformers (its argmax and
  log-softmax, ``greedy_reference``);
- seeded samples: the sampler's documented counter-based draws (a candidate's draw depends on its seed and step
  only) written apart in ``references.ref_sampled``, over the same plain forwards, with the request's penalties,
  temperature and top-p; logprobs from that forward's log-softmax (``references.check_reference``);
- constrained rows: the same loop under the masks of llguidance's own matcher (``references.grammar_allowed``);
- stop strings: the reference answer's text (the tokenizer's decode) cut where the stop string first appears.

A proposer that always guesses right (``Oracle``, told the reference answer) and one that always guesses wrong
both give the reference answer; prompt lookup (``NgramProposer``) and a draft model give it too, with penalties,
stop rules, ``n`` and other traffic in the batch."""

from __future__ import annotations

import pytest
import torch

from app.engine.params import SamplingParams
from app.engine.core.speculative import MISSES_TO_PAUSE, PAUSE, NgramProposer, NgramState, Speculation
from conftest import make_settings
from references import Oracle, check_reference, continuation, grammar_allowed, ref_sampled


# -- the proposer, no model --------------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_earlier_match_longest_first():
    proposer, state = NgramProposer(min_n=2, max_n=3), NgramState()
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # [1, 2, 3] ends earlier at position 3 (followed by 4, 5, ...); [2, 3] later at 8 (followed by 7): longest wins
    assert proposer.propose(state, tokens, 3) == [4, 5, 9]
    assert proposer.propose(NgramState(), tokens, 1) == [4]
    assert proposer.propose(NgramState(), [*tokens[:-1], 6], 3) == []  # [1, 2, 6] and [2, 6] never occurred
    # the index grows with the sequence: the newest occurrence of [2, 3] now is followed by 4
    grown = [*tokens, 4, 0, 2, 3]
    assert proposer.propose(state, grown, 2) == [4, 0]
    assert proposer.propose(state, grown, 0) == []


def test_a_long_sequence_is_indexed_over_several_guesses_newest_first(monkeypatch):
    """A long prompt's n-grams go into the index a bounded number of positions per guess, from the newest back, so
    no step stalls on it; an older occurrence indexed later never replaces a newer one."""
    from app.engine.core import speculative

    monkeypatch.setattr(speculative, "INDEX_PER_STEP", 4)
    proposer, state = NgramProposer(min_n=2, max_n=2), NgramState()
    tokens = [1, 2, 3, *range(10, 30), 1, 2, 4, *range(40, 50), 1, 2]  # [1, 2] followed by 3, later by 4
    guesses = [proposer.propose(state, tokens, 2) for _ in range(12)]
    assert guesses[0] == []  # only the newest positions are in the index yet
    first = next(i for i, g in enumerate(guesses) if g)
    assert 0 < first < 12 and all(g == [4, 40] for g in guesses[first:])  # the newer occurrence, kept
    assert state.low == 1 and len(state.index) == len(tokens) - 3  # every bigram in by now ([1, 2] twice)


def test_a_sequence_whose_guesses_fail_pauses_and_one_that_hits_goes_on():
    proposer, state = NgramProposer(), NgramState()
    tokens = [1, 2, 3, 1, 2]
    for _ in range(MISSES_TO_PAUSE):
        assert proposer.propose(state, tokens, 2) == [3, 1]
        proposer.record(state, 2, 0)
    assert [proposer.propose(state, tokens, 2) for _ in range(PAUSE)] == [[]] * PAUSE
    assert proposer.propose(state, tokens, 2) == [3, 1]
    proposer.record(state, 2, 1)
    assert state.misses == 0 and (state.proposed, state.accepted) == (2 * (MISSES_TO_PAUSE + 1), 1)


# -- the engine ---------------------------------------------------------------------------------------------------
def greedy_reference(model, prompt: list[int], tokens: int) -> list[tuple[int, float]]:
    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(tokens):
            logprobs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].double(), dim=-1)
            token = int(logprobs.argmax())
            out.append((token, float(logprobs[token])))
            ids.append(token)
    return out


def worker_with(path, speculation=None, **kwargs):
    """A worker on ``path``'s model; ``speculation``: the batch's (a test's proposer), or ``speculative=`` config."""
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.core.worker import Worker

    worker = Worker.from_loaded(("m",), load_model(LoadConfig(model=str(path))), max_batch_rows=8, **kwargs)
    if speculation is not None:
        worker.engine.batch.speculation = speculation
    return worker


def prompts_of(tok) -> list[list[int]]:
    """Prompts prompt lookup can copy from (a repeated list), and one it mostly cannot."""
    return [
        tok("red green blue red green blue red green blue red green").input_ids,
        tok("one two three four five six seven eight nine").input_ids,
    ]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("proposer", ["ngram", "right", "wrong"])
def test_greedy_answers_equal_a_plain_forward_whatever_the_guesses(request, reference, kind, proposer):
    """Oracle: ``greedy_reference`` (a plain forward loop's argmax and log-softmax)."""
    path = request.getfixturevalue(f"{kind}_dir")
    model, tok = reference(path)
    prompts, tokens = prompts_of(tok), 24
    expected = [greedy_reference(model, p, tokens) for p in prompts]
    vocab = model.config.vocab_size
    answers = {tuple(p): [t for t, _ in e] for p, e in zip(prompts, expected)}
    chosen = {
        "ngram": NgramProposer(min_n=1, max_n=3),
        "right": Oracle(answers, vocab),
        "wrong": Oracle(answers, vocab, wrong=True),
    }[proposer]
    speculation = Speculation(chosen, 5, 8)
    worker = worker_with(path, speculation)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=1, ignore_eos=True, n=2)
    outputs, _ = worker.complete(prompts, params, 256)
    for output, want in zip(outputs, expected):
        for choice in output.choices:
            assert choice.token_ids == [t for t, _ in want]
            assert choice.logprobs.token_logprobs == pytest.approx([lp for _, lp in want], abs=1e-4)
    assert speculation.draft_tokens > 0
    if proposer == "right":  # every guess kept: a row made up to 6 tokens a step
        assert speculation.accepted_tokens == speculation.draft_tokens
        assert worker.engine.steps <= 2 * -(-tokens // 6) + 4
    elif proposer == "wrong":
        assert speculation.accepted_tokens == 0


def test_seeded_samples_with_penalties_equal_the_documented_draws(llama_dir, reference):
    """Sampled rows with a seed (temperature, top-p, repetition and presence penalties, logprobs 3): a proposer
    that guesses the reference answer has every guess kept, so each token is drawn at a position computed in a
    wider step, with the guesses before it in its penalty history; a wrong one has none kept. Oracle: the
    counter-based draws over a plain forward loop (``references.ref_sampled``) for the tokens, that forward's
    log-softmax for the logprobs and top logprobs (``check_reference``)."""
    model, tok = reference(llama_dir)
    prompts = prompts_of(tok)
    params = SamplingParams(
        max_tokens=20,
        temperature=0.9,
        top_p=0.95,
        seed=11,
        repetition_penalty=1.2,
        presence_penalty=0.4,
        logprobs=3,
        ignore_eos=True,
        n=2,
    )
    # candidate 0's reference answer, what the right proposer guesses (candidate 1's guesses are partly wrong)
    answers = {tuple(p): ref_sampled(model, p, params, 0, 20) for p in prompts}
    for wrong in (False, True):
        speculation = Speculation(Oracle(answers, 10_000, wrong=wrong), 4, 8)
        got, _ = worker_with(llama_dir, speculation).complete(prompts, params, 256)
        for prompt, output in zip(prompts, got):
            check_reference(output, model, tok, prompt, params)
            for choice in output.choices:
                want = ref_sampled(model, prompt, params, choice.index, 20, follow=choice.token_ids)
                assert choice.token_ids == want
                if choice.index == 0:
                    assert want == answers[tuple(prompt)]
        assert speculation.draft_tokens > 0
        assert (speculation.accepted_tokens > 0) is not wrong


def test_stop_rules_cut_a_run_of_kept_guesses(gpt2_dir, reference):
    """``max_tokens``, a stop token and a stop string inside a run of kept guesses end the answer where they end the
    reference answer. Oracle: ``greedy_reference`` (a plain forward loop), its text (the tokenizer's decode) cut
    before the stop string's first occurrence."""
    model, tok = reference(gpt2_dir)
    prompt = prompts_of(tok)[0]
    want = [t for t, _ in greedy_reference(model, prompt, 30)]
    speculation = Speculation(Oracle({tuple(prompt): want}, model.config.vocab_size), 6, 8)
    worker = worker_with(gpt2_dir, speculation)
    (short,), _ = worker.complete([prompt], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True), 256)
    assert short.choices[0].token_ids == want[:9] and short.choices[0].finish_reason == "length"
    stop_at = 13
    params = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(want[stop_at],), ignore_eos=True)
    (stopped,), _ = worker.complete([prompt], params, 256)
    first = want.index(want[stop_at])
    assert stopped.choices[0].token_ids == want[: first + 1] and stopped.choices[0].finish_reason == "stop"
    cut = tok.decode(want[:20])[len(tok.decode(want[:12])) :].strip()[:3]
    assert cut
    params = SamplingParams(max_tokens=30, temperature=0.0, stop=(cut,), ignore_eos=True)
    text = continuation(tok, prompt, prompt + want)
    assert text.index(cut) < len(continuation(tok, prompt, prompt + want[:20]))  # the stop string comes in time
    accepted = speculation.accepted_tokens
    (spec,), _ = worker.complete([prompt], params, 256)
    assert (spec.choices[0].text, spec.choices[0].finish_reason) == (text[: text.index(cut)], "stop")
    assert spec.choices[0].token_ids == want[: len(spec.choices[0].token_ids)]
    assert speculation.accepted_tokens > accepted  # the stop string came inside a run of kept guesses


def test_no_guesses_above_the_row_limit_or_without_room(gpt2_dir, reference):
    """A batch wider than ``max_rows`` guesses nothing; nor does a row whose answer has no room for a guess. (No
    answer is compared here: the counters are the subject.)"""
    model, tok = reference(gpt2_dir)
    prompts = prompts_of(tok)
    speculation = Speculation(NgramProposer(min_n=1), 4, 1)
    worker = worker_with(gpt2_dir, speculation)
    worker.complete(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=2), 256)
    assert speculation.draft_tokens == 0
    speculation.max_rows = 8
    worker.complete(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), 256)
    assert speculation.draft_tokens == 0
    worker.complete(prompts[:1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), 256)
    assert speculation.draft_tokens > 0  # the same prompt with room does guess


@pytest.mark.parametrize("wrong", [False, True])
def test_constrained_rows_guess_what_their_grammar_allows_and_answer_as_the_reference(gpt2_dir, reference, wrong):
    """Structured outputs under speculation: a constrained row's guesses are cut to those its grammar allows, each
    guessed position is sampled under the mask the row would have there, and its matcher takes the tokens kept. A
    proposer that guesses the reference answer has every guess kept (greedy and seeded sampling, ``n=2``); a wrong
    one has its guesses cut or refused. Oracle: a plain forward loop under the masks of llguidance's own matcher
    (``references.grammar_allowed``), its argmax or counter-based draw (``references.ref_sampled``); its
    log-softmax for the logprobs; each finished text a full match of the pattern."""
    import re

    from app.engine.params import Constraint

    model, tok = reference(gpt2_dir)
    prompts = prompts_of(tok)
    pattern = "(red|green|blue)( (red|green|blue)){5,30}"
    constraint = Constraint("regex", pattern)
    eos = tok.eos_token_id
    allowed = grammar_allowed(tok, pattern, eos)
    for params in (
        SamplingParams(max_tokens=40, temperature=0.0, logprobs=1, constraint=constraint),
        SamplingParams(max_tokens=40, temperature=0.9, seed=2, logprobs=1, n=2, constraint=constraint),
    ):
        answers = {tuple(p): ref_sampled(model, p, params, 0, 40, allowed=allowed, eos=eos) for p in prompts}
        speculation = Speculation(Oracle(answers, 400, wrong=wrong), 4, 8)
        got, _ = worker_with(gpt2_dir, speculation).complete(prompts, params, 256)
        for prompt, output in zip(prompts, got):
            check_reference(output, model, tok, prompt, params)
            for choice in output.choices:
                want = ref_sampled(
                    model, prompt, params, choice.index, 40, allowed=allowed, eos=eos, follow=choice.token_ids
                )
                assert choice.token_ids == want
                ended = want[-1] == eos or allowed.complete(want)
                assert choice.finish_reason == ("stop" if ended else "length")
                if choice.finish_reason == "stop":
                    assert re.fullmatch(pattern, choice.text)
        if wrong:
            assert speculation.accepted_tokens == 0
        else:
            assert speculation.accepted_tokens > 0 and speculation.draft_tokens > 0


def truncated(path, out):
    """A draft with the target's tokenizer: the target's first layer alone (its embeddings, head and layer 0)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path)
    model.transformer.h = model.transformer.h[:1]
    model.config.n_layer = 1
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(path).save_pretrained(out)
    return out


@pytest.mark.parametrize("draft", ["itself", "its first layer"])
def test_a_draft_model_gives_the_plain_answer(gpt2_dir, reference, tmp_path, draft):
    """A draft model (``DraftProposer``): the target itself (its greedy guesses are the target's answer: every one
    kept) and the target's first layer alone (guesses often refused, so its cache is cut back and fed again). Both
    give a plain forward's greedy tokens and logprobs, for two prompts with two candidates each (oracle:
    ``greedy_reference``), and sampled rows with a seed give the documented counter-based draws over that forward
    (oracle: ``references.ref_sampled``)."""
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.core.speculative import SpeculativeConfig

    model, tok = reference(gpt2_dir)
    source = gpt2_dir if draft == "itself" else truncated(gpt2_dir, tmp_path / "draft")
    config = SpeculativeConfig("draft", 4, 8, draft=lambda: load_model(LoadConfig(model=str(source))))
    worker = worker_with(gpt2_dir, speculative=config)
    speculation = worker.engine.batch.speculation
    prompts, tokens = prompts_of(tok), 24
    params = SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=1, ignore_eos=True, n=2)
    outputs, _ = worker.complete(prompts, params, 256)
    for prompt, output in zip(prompts, outputs):
        want = greedy_reference(model, prompt, tokens)
        for choice in output.choices:
            assert choice.token_ids == [t for t, _ in want]
            assert choice.logprobs.token_logprobs == pytest.approx([lp for _, lp in want], abs=1e-4)
    if draft == "itself":
        assert speculation.accepted_tokens >= 0.9 * speculation.draft_tokens > 0
    else:
        assert 0 < speculation.accepted_tokens < speculation.draft_tokens
    sampled = SamplingParams(max_tokens=16, temperature=0.8, seed=4, logprobs=2, ignore_eos=True, n=2)
    drafted = speculation.draft_tokens
    got, _ = worker.complete(prompts, sampled, 256)
    assert speculation.draft_tokens > drafted  # the sampled rows were guessed for too
    for prompt, output in zip(prompts, got):
        check_reference(output, model, tok, prompt, sampled)
        for choice in output.choices:
            assert choice.token_ids == ref_sampled(model, prompt, sampled, choice.index, 16, follow=choice.token_ids)


def draft_of(path, rows: int = 4, tokens: int = 4, vocab: int | None = None):
    """``DraftProposer`` over ``path``'s model (its own runner and block pool), guessing for at most ``rows``
    sequences at once."""
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.model.runner import ModelRunner
    from app.engine.core.speculative import DraftProposer

    loaded = load_model(LoadConfig(model=str(path)))
    runner = ModelRunner(loaded.model, loaded.tokenizer, ())
    return DraftProposer(runner, vocab or loaded.model.config.vocab_size, rows, tokens)


def test_a_draft_guesses_every_row_at_once_from_its_own_blocks(gpt2_dir, reference):
    """The target as its own draft: the guesses for three sequences at once, and for one alone, are each sequence's
    greedy continuation (oracle: ``greedy_reference``, a plain forward loop's argmax); the keys and values are in
    the draft's block pool, a sequence's blocks covering what it holds (its tokens and the guesses fed)."""
    from app.engine.core.blocks import BLOCK
    from app.engine.core.speculative import DraftState

    model, tok = reference(gpt2_dir)
    proposer = draft_of(gpt2_dir)
    prompts = [*prompts_of(tok), tok("a b c d e f g a b c").input_ids]
    states = [DraftState() for _ in prompts]
    got = proposer.propose_rows(states, prompts, [4, 3, 4])
    for prompt, guess, state, k in zip(prompts, got, states, [4, 3, 4]):
        assert guess == [t for t, _ in greedy_reference(model, prompt, k)]
        assert state.held == prompt + guess[:-1] and len(state.blocks) * BLOCK >= len(state.held)
    states.append(DraftState())
    assert proposer.propose(states[-1], prompts[1], 4) == [t for t, _ in greedy_reference(model, prompts[1], 4)]
    assert proposer.batch.blocks.held_blocks == sum(len(s.blocks) for s in states)


def test_a_draft_cut_back_after_refused_guesses_guesses_as_a_fresh_one(gpt2_dir, reference):
    """After guesses the sequence did not keep, a row's held tokens are cut back to what the sequence holds (their
    positions written again), so its next guess is the one a fresh sequence over the same tokens gives; a draft
    whose vocabulary is larger than the served model's never guesses past the served one's. Oracle:
    ``greedy_reference`` over the same tokens (the draft is the target itself)."""
    from app.engine.core.speculative import DraftState

    model, tok = reference(gpt2_dir)
    proposer = draft_of(gpt2_dir)
    tokens = prompts_of(tok)[0]
    state = DraftState()
    first = proposer.propose(state, tokens, 4)
    assert len(first) == 4 and len(state.held) == len(tokens) + 3
    for taken in ([first[0], (first[1] + 1) % 400], [(first[0] + 7) % 400], first + [first[0]]):
        tokens = tokens + taken
        assert proposer.propose(state, tokens, 3) == [t for t, _ in greedy_reference(model, tokens, 3)]
        assert state.held[: len(tokens)] == tokens
    assert all(t < 50 for t in draft_of(gpt2_dir, vocab=50).propose(DraftState(), tokens, 4))


def test_a_draft_pool_gives_the_least_recent_sequences_blocks_to_a_new_one(gpt2_dir, reference, monkeypatch):
    """A pool for one sequence at a time: two sequences guessing in turn take the blocks from each other (the other
    is fed again from its start), and each guess is still its greedy continuation (oracle: ``greedy_reference``). A
    long prompt is fed a bounded number of tokens per step (``CATCH_UP``): no guesses until it is all in."""
    from app.engine.core import speculative
    from app.engine.core.speculative import DraftState

    model, tok = reference(gpt2_dir)
    proposer = draft_of(gpt2_dir, rows=1)  # 256 positions (the context) and 4 guesses: 17 blocks and the null one
    prompts = [tok("red green blue " * 50).input_ids[:150], tok("one two three four " * 40).input_ids[:150]]
    assert all(len(p) == 150 for p in prompts)  # 10 blocks each: the two do not fit together
    states = [DraftState(), DraftState()]
    for turn in range(4):
        row = turn % 2
        guess = proposer.propose(states[row], prompts[row], 3)
        assert guess == [t for t, _ in greedy_reference(model, prompts[row], 3)]
        assert states[1 - row].blocks == [] or turn == 0
    monkeypatch.setattr(speculative, "CATCH_UP", 4)
    state, prompt = DraftState(), prompts_of(tok)[0]
    steps = [proposer.propose(state, prompt, 3) for _ in range(-(-len(prompt) // 4))]
    assert steps[:-1] == [[]] * (len(steps) - 1)
    assert steps[-1] == [t for t, _ in greedy_reference(model, prompt, 3)]


def test_a_draft_model_with_another_vocabulary_is_refused(gpt2_dir, llama_dir):
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.core.speculative import SpeculativeConfig
    from app.errors import ConfigError

    from types import SimpleNamespace

    config = SpeculativeConfig("draft", draft=lambda: load_model(LoadConfig(model=str(llama_dir))))
    target = load_model(LoadConfig(model=str(gpt2_dir)))
    with pytest.raises(ConfigError, match="another vocabulary"):
        config.build(SimpleNamespace(tokenizer=target.tokenizer, vocab_size=target.model.config.vocab_size))
    with pytest.raises(ValueError, match="speculative_model"):
        make_settings(speculative="draft")


@pytest.mark.slow
def test_the_default_configuration_gives_the_same_bits_with_speculation(saker_cache):
    """The embedded SmolLM2 as served (int4, the fixed-order attention kernel): a JSON rewrite of a record given in
    the prompt (prompt lookup keeps most guesses) gives the tokens and logprobs of a plain forward over the same
    modules (within 1e-5: the reference's log-softmax is in float64), though most positions were computed in steps
    of up to 5 tokens. The reference is one forward of the prompt and the answer (each answer token must be its
    position's argmax, so a greedy loop would have made the same tokens): 48 forwards of the whole sequence took
    most of this test's 9 minutes on a loaded 2-core machine."""
    from tooling.bench.parts.p import TASKS
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.core.speculative import SpeculativeConfig
    from app.engine.core.worker import Worker

    loaded = load_model(LoadConfig(cache_dir=str(saker_cache)))
    worker = Worker.from_loaded(("m",), loaded, speculative=SpeculativeConfig("ngram", 4, 4))
    assert "int4" in worker.info.precision
    messages = [{"role": "user", "content": TASKS["grounded"]}]
    prompt = list(
        worker.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    tokens = 48
    (output,), timings = worker.complete([prompt], SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=1), 8192)
    choice = output.choices[0]
    made = choice.token_ids
    assert len(made) == tokens or made[-1] in worker.runner.eos_token_ids
    with torch.inference_mode():
        logits = worker.runner.model(input_ids=torch.tensor([prompt + made])).logits[0, len(prompt) - 1 : -1]
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert made == reference.argmax(-1).tolist()
    assert choice.logprobs.token_logprobs == pytest.approx(
        [float(reference[i, t]) for i, t in enumerate(made)], abs=1e-5
    )
    assert timings.accepted_tokens >= tokens // 2, timings


def test_prompt_lookup_is_the_default_on_the_cpu_and_off_on_cuda(monkeypatch):
    """``SAKER_SPECULATIVE`` unset: ngram on the CPU (where bench part P shows it pays), off on CUDA (its fixed-order
    kernels are not measured there); a value set is kept either way."""
    from app.engine.model import loader
    from app.engine.model.load_config import LoadConfig
    from app.engine.core import speculative

    monkeypatch.setattr(loader, "resolve_device", lambda config: "cpu")  # whatever device this machine has
    assert speculative.method(LoadConfig()) == "ngram"
    assert speculative.method(LoadConfig(speculative="off")) == "off"
    monkeypatch.setattr(loader, "resolve_device", lambda config: "cuda:0")
    assert speculative.method(LoadConfig()) == "off"
    assert speculative.method(LoadConfig(speculative="ngram")) == "ngram"


def test_the_default_kv_budget_is_taken_after_the_draft_model_loads(gpt2_dir, monkeypatch):
    """On CUDA the default budget is 90 % of the free GPU memory: it must be measured once the draft model and its
    own pool hold theirs, or the served model's pool would take memory the draft already has."""
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.model.runner import ModelRunner
    from app.engine.core.speculative import SpeculativeConfig

    order = []
    real = ModelRunner.default_kv_budget

    def budget(runner):
        order.append("budget")
        return real(runner)

    def draft():
        order.append("draft")
        return load_model(LoadConfig(model=str(gpt2_dir)))

    monkeypatch.setattr(ModelRunner, "default_kv_budget", budget)
    worker = worker_with(gpt2_dir, speculative=SpeculativeConfig("draft", 4, 4, draft=draft))
    assert "budget" in order[order.index("draft") :]  # (the warm-up's one-request run before it sizes its own)
    assert worker.kv_cache_tokens == worker.engine.batch.budget > 0


def test_the_scheduler_plans_the_guesses_and_the_step_checks_those(gpt2_dir, reference, monkeypatch):
    """The rows' guesses are part of the step's plan (``SchedulerOutput.guesses``, proposed while scheduling and
    fitted to the free blocks), and the forward checks exactly those: every step whose plan had guesses got the
    plan's list, and an oracle's guesses are all kept.
    Oracle for the answer: a plain forward loop (``greedy_reference``)."""
    from app.engine.core import engine_core

    model, tok = reference(gpt2_dir)
    prompt, tokens = prompts_of(tok)[0], 20
    want = [t for t, _ in greedy_reference(model, prompt, tokens)]
    speculation = Speculation(Oracle({tuple(prompt): want}, model.config.vocab_size), 4, 8)
    worker = worker_with(gpt2_dir, speculation)
    planned, checked = [], []
    real_schedule, real_step = worker.engine.scheduler.schedule, engine_core.decode_step

    def schedule():
        plan = real_schedule()
        planned.append(plan)
        return plan

    def decode_step(batch, jobs=(), guesses=None):
        checked.append((planned[-1], guesses))
        return real_step(batch, jobs, guesses)

    monkeypatch.setattr(worker.engine.scheduler, "schedule", schedule)
    monkeypatch.setattr(engine_core, "decode_step", decode_step)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    [output], _ = worker.complete([prompt], params, 256)
    assert output.choices[0].token_ids == want
    # the first step joins the prompt (computed apart) before its rows guess; after that each step is planned whole
    carried = [(plan, guesses) for plan, guesses in checked if plan.guesses is not None and any(plan.guesses)]
    assert len(carried) >= 2 and all(guesses is plan.guesses for plan, guesses in carried)
    assert speculation.draft_tokens > 0 and speculation.accepted_tokens == speculation.draft_tokens
