"""SAKER_COMPILE, proven on the CPU: the continuous batch's decode-only step (``ModelRunner.rows_step``) is one graph
for torch.compile (``fullgraph=True``: no graph break) and is not compiled again while requests join and leave
the batch (only a new batch bucket would be). The compiled answers are checked against references outside the
engine: greedy tokens are a plain forward's argmax and every logprob its log-softmax (within 1e-4,
``references.check_reference``), seeded samples are the sampler's documented counter-based draws over that forward
(``references.ref_sampled``). The CUDA-graph replay of the same step is checked on a GPU (tests/engine/test_models.py).

Inductor keeps its kernels where ``TORCHINDUCTOR_CACHE_DIR`` says; the loader sets it when compiling (and torch
itself sets it on its first compile), so the module points it at a folder of its own first (kept in the repo's
ignored .cache/, so a later run finds the kernels) and puts it back after: no later test finds it set by these."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch._dynamo

from app.engine.core.blocks import BLOCK
from app.engine.core.batches import bucket
from app.engine.core.sequence import RequestGroup
from app.engine.output.decoder import collect
from app.engine.params import SamplingParams
from conftest import make_settings
from references import check_reference, ref_sampled

TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def inductor_cache(saker_cache):
    """``TORCHINDUCTOR_CACHE_DIR`` set to this module's folder while it runs, and back to what it was (unset,
    usually) after: set first, so that the teardown undoes what the loader and torch write there."""
    with pytest.MonkeyPatch.context() as patch:
        path = saker_cache.parent / "inductor-tests"
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def compiled(gpt2_dir):
    """A worker whose decode step is compiled (inductor on the CPU, buckets 1 and 2)."""
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.core.worker import Worker

    torch._dynamo.reset()
    settings = make_settings(model=str(gpt2_dir))
    yield Worker.from_loaded(("m",), load_model(LoadConfig.of(settings)), max_batch_rows=2, compile=True)
    torch._dynamo.reset()


def check(model, tok, requests, outputs, tol=TOL):
    """Each answer against the model loaded by transformers: greedy tokens its argmax and logprobs its
    log-softmax (``check_reference``); a seeded sampled answer's tokens the documented draws over its forward."""
    for (ids, params), output in zip(requests, outputs):
        check_reference(output, model, tok, ids, params, tol=tol)
        for choice in output.choices:
            if params.ignore_eos:
                assert len(choice.token_ids) == params.max_tokens
            if not params.greedy:
                want = ref_sampled(model, ids, params, choice.index, len(choice.token_ids), follow=choice.token_ids)
                assert choice.token_ids == want


def run(worker, requests):
    """Submit ``requests`` [(ids, params)] together; their outputs."""
    groups = [
        RequestGroup(worker.runner, ids, params, max_length=256, tag=i) for i, (ids, params) in enumerate(requests)
    ]
    per = {i: [] for i in range(len(requests))}
    for tag, event in worker.engine.submit(groups):
        per[tag].append(event)
    return [collect(per[i], params) for i, (_, params) in enumerate(requests)]


@contextlib.contextmanager
def no_new_graphs():
    """Nothing in the body compiles a graph (dynamo's counters are global; its config is per thread, so
    ``error_on_recompile`` would not reach the scheduler's thread)."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    yield
    assert counters["stats"]["unique_graphs"] == before, "a join or leave compiled a new graph"


def count_calls(worker, monkeypatch) -> dict:
    """Count the compiled step's calls per bucket (rows); ``"views"``: each call's (window, the longest window)."""
    calls: dict[int, int] = {}
    runner = worker.runner
    step = runner.compiled_step

    def counted(tokens, positions, write, gather, *args, **kwargs):
        calls[tokens.shape[0]] = calls.get(tokens.shape[0], 0) + 1
        views.append((gather.shape[1] * BLOCK, worker.engine.batch.capacity))
        return step(tokens, positions, write, gather, *args, **kwargs)

    views: list[tuple[int, int]] = []
    calls["views"] = views  # type: ignore[assignment]

    monkeypatch.setattr(runner, "compiled_step", counted)
    return calls


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 5, 9, 17, 25, 32, 33, 64, 65)] == [1, 2, 4, 8, 16, 24, 32, 32, 40, 64, 72]


def test_windows():
    from app.engine.core.batches import window, windows

    assert windows(8192) == (256, 512, 1024, 2048, 4096, 8192)
    assert windows(3072) == (256, 512, 1024, 2048, 3072) and windows(200) == (200,)
    assert [window(n, 3072) for n in (1, 256, 257, 2049, 3072)] == [256, 256, 512, 3072, 3072]


def test_compiled_step_is_one_graph_and_joins_and_leaves_recompile_nothing(compiled, reference, gpt2_dir, monkeypatch):
    """Oracle: transformers' own model (a plain forward's argmax and log-softmax, the counter-based draws over
    it)."""
    assert compiled.runner.compiled_step is not None
    model, tok = reference(gpt2_dir)
    calls = count_calls(compiled, monkeypatch)
    requests = [
        (
            tok("Once upon a time").input_ids,
            SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True),
        ),
        (
            tok("Hello").input_ids,
            SamplingParams(max_tokens=5, temperature=0.0, logprobs=0, ignore_eos=True),
        ),  # leaves early
        (
            tok("The capital of France is").input_ids,
            SamplingParams(max_tokens=7, temperature=0.8, seed=3, logprobs=1, ignore_eos=True),
        ),
    ]
    for _ in range(2):  # the third joins when the second leaves; then all again
        with no_new_graphs():  # warm-up compiled every bucket
            got = run(compiled, requests)
        check(model, tok, requests, got)
    assert compiled.engine.max_rows_seen == 2
    views = calls.pop("views")
    # decode-only steps ran compiled, in the buckets of the rows they had (a step that carries a prompt's chunk
    # runs the eager flat step instead)
    assert set(calls) <= {1, 2} and calls.get(2)
    # short requests attend over the smallest window (here the whole context: the tiny GPT-2's is 256 positions)
    assert {view for view, _ in views} == {256} and {capacity for _, capacity in views} == {256}


def test_n_candidates_fill_one_bucket(compiled, reference, gpt2_dir, monkeypatch):
    """Oracle: the counter-based draws over a plain forward (tokens), its log-softmax (logprobs)."""
    model, tok = reference(gpt2_dir)
    calls = count_calls(compiled, monkeypatch)
    params = SamplingParams(max_tokens=6, temperature=0.7, seed=9, n=2, logprobs=1, ignore_eos=True)
    request = [(tok("Hello there").input_ids, params)]
    with no_new_graphs():
        (a,) = run(compiled, request)
    assert calls[2] == 5  # 6 tokens: 1 from the prefill
    check(model, tok, request, [a])
    assert a.choices[0].token_ids != a.choices[1].token_ids  # two candidates, two streams of draws


def test_guess_checking_steps_run_compiled_and_answer_as_a_plain_forward(compiled, reference, gpt2_dir, monkeypatch):
    """Speculative decoding on the compiled step: a row that checks a guess is two queries of the decode-only step
    (its next token and the guess, each on the row's blocks at its own position), so it runs in the warmed-up
    bucket of 2, compiles nothing new, and gives a plain forward's greedy answer (oracle: a loop of whole-sequence
    forwards, their argmax and log-softmax, within 1e-4)."""
    from app.engine.core.speculative import Proposer, Speculation
    from references import ref_logprobs

    model, tok = reference(gpt2_dir)
    ids = tok("Hello there").input_ids
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True)
    answer: list[int] = []
    for _ in range(12):
        answer.append(int(ref_logprobs(model, ids + answer)[-1].argmax()))
    lp = ref_logprobs(model, ids + answer)
    want = [lp[len(ids) - 1 + i, t].item() for i, t in enumerate(answer)]

    class Right(Proposer):  # guesses the reference answer's next token
        def guess(self, state, tokens, k):
            return answer[len(tokens) - len(ids) : len(tokens) - len(ids) + k]

    speculation = Speculation(Right(), 1, 1)
    monkeypatch.setattr(compiled.engine.batch, "speculation", speculation)
    calls = count_calls(compiled, monkeypatch)
    with no_new_graphs():
        (got,) = run(compiled, [(ids, params)])
    assert got.choices[0].token_ids == answer
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(want, abs=TOL)
    assert speculation.accepted_tokens == speculation.draft_tokens > 0
    assert calls.get(2) and calls[2] <= 6  # 11 tokens after the prefill's, up to 2 a step


def test_an_int4_model_compiles_to_few_graphs_and_answers_as_a_plain_forward(llama_dir, tmp_path):
    """SAKER_QUANTIZE=int4 with SAKER_COMPILE: the int4 kernel's op sits inside the compiled step (no graph
    break), the batch buckets and attention windows share a few graphs that joins and leaves do not recompile,
    and the answers are the int4 model's own (oracle: a loop of plain whole-sequence forwards of the model as
    loaded, no engine: its argmax, its log-softmax within 1e-4)."""
    from torch._dynamo.utils import counters

    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.model.quantize import Int4Linear
    from app.engine.core.worker import Worker

    torch._dynamo.reset()
    settings = make_settings(model=str(llama_dir), quantize="int4", cache_dir=str(tmp_path))
    before = counters["stats"]["unique_graphs"]
    compiled = Worker.from_loaded(("m",), load_model(LoadConfig.of(settings)), max_batch_rows=2, compile=True)
    # buckets 1 and 2, each with every window (256, 512, ... the capacity): a handful of graphs, not one per pair
    # (the first shapes static; then the window and the rows dynamic; the whole capacity its own)
    assert counters["stats"]["unique_graphs"] - before <= 4
    plain = load_model(LoadConfig.of(settings)).model
    assert any(isinstance(m, Int4Linear) for m in compiled.runner.model.modules())
    assert any(isinstance(m, Int4Linear) for m in plain.modules())
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=1, ignore_eos=True)
    requests = [([1, 5, 9, 13], params), ([2, 4, 6], params), ([7, 3], params)]
    with no_new_graphs():
        got = run(compiled, requests)
    for (ids, _), output in zip(requests, got):
        tokens, logprobs = [], []
        for _ in range(10):
            with torch.no_grad():
                row = torch.log_softmax(plain(torch.tensor([ids + tokens])).logits[0, -1].float(), -1)
            tokens.append(int(row.argmax()))
            logprobs.append(row[tokens[-1]].item())
        assert output.choices[0].token_ids == tokens
        assert output.choices[0].logprobs.token_logprobs == pytest.approx(logprobs, abs=TOL)
    torch._dynamo.reset()


@pytest.mark.parametrize("compile_, kept", [(True, True), (None, False), (False, False)])
def test_inductors_cache_is_kept_with_sakers_when_compiling(gpt2_dir, tmp_path, monkeypatch, compile_, kept):
    """Compiling (asked, or unset on CUDA), inductor's kernels go under ``cache_dir`` so that a restart finds them;
    on the CPU with compile unset nothing is compiled and the variable is left alone. (The module's
    ``inductor_cache`` set it before, so this ``delenv`` is recorded and undone: the loader's value does not stay.)"""
    import os

    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model

    assert "TORCHINDUCTOR_CACHE_DIR" in os.environ
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    load_model(LoadConfig(model=str(gpt2_dir), device="cpu", compile=compile_, cache_dir=str(tmp_path)))
    assert (os.environ.get("TORCHINDUCTOR_CACHE_DIR") == str(tmp_path / "inductor")) is kept
