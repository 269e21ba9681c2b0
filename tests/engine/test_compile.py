"""SAKER_COMPILE, proven on the CPU.

- A float32 model: the continuous batch's decode-only step (``ModelRunner.rows_step``) is one graph for
  torch.compile (``fullgraph=True``: no graph break) and is not compiled again while requests join and leave the
  batch (only a new batch bucket would be).
- An int4 model (the CPU's fixed-order kernel path, the embedded default's): every step, decode rows,
  prompt chunks and both together, goes through one compiled graph of the flat step (``ModelRunner.flat_forward``,
  the token count dynamic), which no step compiles again, a lone row's included.

The compiled answers are checked against references outside the engine: greedy tokens are a plain forward's argmax
and every logprob its log-softmax (within 1e-4, ``references.check_reference``), greedy tokens those of
``generate()``, seeded samples the sampler's documented counter-based draws over that forward
(``references.ref_sampled``). The CUDA-graph replay of the decode step is checked on a GPU
(tests/engine/test_models.py).

Inductor keeps its kernels where ``TORCHINDUCTOR_CACHE_DIR`` says; the loader sets it when compiling (and torch
itself sets it on its first compile), so the module points it at a folder of its own first (kept in the repo's
ignored .cache/, so a later run finds the kernels) and puts it back after: no later test finds it set by these."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch
import torch._dynamo

from app.engine.core.blocks import BLOCK
from app.engine.model.shapes import bucket
from app.engine.core.sequence import RequestGroup
from app.engine.output.decoder import collect
from app.engine.model.runner import COMPILE_FLAT_BY_DEFAULT
from app.engine.params import SamplingParams
from conftest import make_settings
from references import check_reference, check_served, ref_sampled, serve_alone_and_beside

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
    from app.engine.model.shapes import window, windows

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


@pytest.mark.parametrize(
    "model, quantize, compile_, kept",
    [
        ("gpt2", None, True, True),
        ("gpt2", None, None, False),
        ("gpt2", None, False, False),
        ("llama", "int4", True, True),
        ("llama", "int4", None, COMPILE_FLAT_BY_DEFAULT),
    ],
)
def test_inductors_cache_is_kept_with_sakers_when_compiling(
    gpt2_dir, llama_dir, tmp_path, monkeypatch, model, quantize, compile_, kept
):
    """Compiling (asked, or unset on CUDA, and for an int4/int8 model on the CPU where its flat step compiles by
    default), inductor's kernels go under ``cache_dir`` so that a restart finds them; on the CPU with compile unset
    nothing else is compiled and the variable is left alone. (The module's ``inductor_cache`` set it before, so this
    ``delenv`` is recorded and undone: the loader's value does not stay.)"""
    import os

    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model

    assert "TORCHINDUCTOR_CACHE_DIR" in os.environ
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    path = str(gpt2_dir if model == "gpt2" else llama_dir)
    load_model(LoadConfig(model=path, device="cpu", quantize=quantize, compile=compile_, cache_dir=str(tmp_path)))
    assert (os.environ.get("TORCHINDUCTOR_CACHE_DIR") == str(tmp_path / "inductor")) is kept


# -- the compiled flat step (the CPU's kernel path: int4/int8 models) --------------------------------------------
@pytest.fixture(scope="module")
def flat_compiled(llama_dir, tmp_path_factory):
    """The tiny Llama served int4 (attention by the fixed-order kernel over a float32 pool) with its flat step
    compiled once for the module, prompts in chunks of 8 while rows decode; and the same int4 model loaded again,
    outside any engine (the plain forward the answers are checked against)."""
    from app.engine.core.worker import Worker
    from app.engine.model.attention import use_engine_attention
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    config = LoadConfig(model=str(llama_dir), quantize="int4", cache_dir=str(tmp_path_factory.mktemp("flat")))
    before = counters["stats"]["unique_graphs"]
    worker = Worker.from_loaded(
        ("m",), load_model(config), max_batch_rows=4, compile=True, prefill_chunk_tokens=8, prefix_cache_tokens=0
    )
    # compiled and checked at start: the first warm-up step made the one graph, the lone row's went through it
    assert counters["stats"]["unique_graphs"] - before == 1
    plain = load_model(config).model
    # its own attention, as served (``use_engine_attention``: the fixed-order path of a model whose linears round
    # their inputs); with SDPA's float32 ulps instead, the int16 rounding before each int4 product moves this random
    # tiny model's logprobs by about 1e-4 over ten tokens
    assert use_engine_attention(plain)
    yield worker, plain
    torch._dynamo.reset()


def test_every_step_runs_one_compiled_flat_graph_and_answers_as_a_plain_forward(flat_compiled, monkeypatch):
    """A request alone, then beside others: requests of several lengths decoding while a long prompt's chunks ride
    in their steps (mixed steps), rows joining and leaving. Every step (decode rows alone, prompt chunks alone, both
    together) runs the one compiled graph, none compiles again, and every answer is the plain forward's (oracle:
    the int4 model as loaded, outside the engine: its argmax and log-softmax within 1e-4, the greedy tokens of its
    ``generate()``)."""
    from torch._dynamo.utils import counters

    from app.engine.model.quantize import Int4Linear

    worker, plain = flat_compiled
    runner = worker.runner
    assert runner.compiled_flat is not None and runner.compiled_step is None
    assert any(isinstance(m, Int4Linear) for m in runner.model.modules())
    sizes, calls, mixed = [], [], []
    graph, real_flat, real_run = runner.compiled_flat, runner.flat_step, runner.run_compiled_flat

    def counted(*args):
        calls.append(True)
        return graph(*args)

    def run_compiled(tokens, *args):
        sizes.append(tokens.shape[0])
        return real_run(tokens, *args)

    def flat_step(tokens, positions, flat, logits_at):
        mixed.append(flat.rows > 0 and bool(flat.chunks))
        return real_flat(tokens, positions, flat, logits_at)

    monkeypatch.setattr(runner, "compiled_flat", counted)
    monkeypatch.setattr(runner, "run_compiled_flat", run_compiled)
    monkeypatch.setattr(runner, "flat_step", flat_step)
    graphs, recompiles = counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())
    check_served(serve_alone_and_beside(worker), plain, worker.tokenizer)
    assert any(mixed), "no step carried decode rows and a prompt chunk together"
    # every step through the graph: of many sizes, a lone row's included (padded to 2 tokens: ``runner.padded``)
    assert len(calls) == len(sizes) and len(set(sizes)) > 3 and 1 in sizes
    assert counters["stats"]["unique_graphs"] == graphs, "a step compiled a new graph"
    assert sum(counters["recompiles"].values()) == recompiles, "a step recompiled the graph"


def test_cudas_bucketed_flat_step_pads_each_step_to_a_captured_size_and_answers_as_a_plain_forward(
    flat_compiled, monkeypatch
):
    """CUDA's compiled flat step (``FlatSizes``: one CUDA graph per token bucket, captured at start-up), run on the
    CPU where inductor makes no CUDA graph but the padding is the same: start-up runs every bucket once; each step
    with prompt chunks then reaches the graph with its tokens padded to a bucket, its tables to (bucket, width) and
    its logits to the bucket's or the cap's rows, so every step replays a captured size; a larger step runs the
    eager flat forward; the decode-only steps keep their own path. Every answer is the plain forward's
    (``serve_alone_and_beside``, ``check_served``). What only a GPU shows (the capture and replay themselves) is
    tests/engine/test_models.py's on a GPU."""
    from app.engine.model.runner import FlatSizes

    worker, plain = flat_compiled
    runner, pool = worker.runner, worker.engine.batch.pool
    monkeypatch.setattr(runner, "compiled_flat", runner.compiled_flat)  # the module's graph back after
    monkeypatch.setattr(runner, "flat_sizes", None)
    # up to 8 tokens: a lone prompt fits, a chunk of 8 beside decoding rows does not (the eager forward runs it)
    sizes = FlatSizes(top=8, width=256 // BLOCK, logits=4)
    assert sizes.buckets == (2, 4, 8)
    shapes, eager = [], []
    real_compile, real_forward = torch.compile, runner.flat_forward

    def compile_counted(fn, **options):
        graph = real_compile(fn, **options)

        def counted(tokens, positions, write, tables, which, hi, logits_at, keys, values):
            shapes.append((tokens.shape[0], tuple(tables.shape), logits_at.shape[0]))
            return graph(tokens, positions, write, tables, which, hi, logits_at, keys, values)

        return counted

    def forward_counted(*args):
        eager.append(args[0].shape[0])
        return real_forward(*args)

    monkeypatch.setattr(torch, "compile", compile_counted)
    assert runner.compile_flat(pool.keys, pool.values, sizes) and runner.flat_sizes is sizes
    # start-up: the two checked steps (12 tokens -> 16, a lone row -> 2), three runs each, then every bucket
    assert {count for count, _, _ in shapes} == set(sizes.buckets)
    shapes.clear()
    monkeypatch.setattr(runner, "flat_forward", forward_counted)
    check_served(serve_alone_and_beside(worker), plain, worker.tokenizer)
    assert shapes, "no step with prompt chunks went through the graph"
    for count, tables, logits in shapes:
        assert count in sizes.buckets and tables == (count, sizes.width) and logits == min(count, sizes.logits)
    assert eager, "no step beyond the captured sizes ran the eager forward"


def test_a_compiled_flat_step_that_is_not_the_eager_forward_to_the_bit_is_not_used(flat_compiled, monkeypatch, caplog):
    """The start-up check: a graph whose logits differ from the eager forward's by one float32 ulp's worth (1e-6
    added here) is dropped, with a warning, and the steps stay eager; so is one that cannot be compiled."""
    worker, _ = flat_compiled
    runner, pool = worker.runner, worker.engine.batch.pool
    monkeypatch.setattr(runner, "compiled_flat", runner.compiled_flat)  # the module's graph back after
    monkeypatch.setattr(torch, "compile", lambda fn, **_: lambda *args: fn(*args) + 1e-6)
    assert not runner.compile_flat(pool.keys, pool.values) and runner.compiled_flat is None
    assert "not used: its logits differ from the eager forward's (up to 1" in caplog.text

    def fails(*args):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch, "compile", lambda fn, **_: fails)
    assert not runner.compile_flat(pool.keys, pool.values) and runner.compiled_flat is None
    assert "not used: it could not be compiled (RuntimeError: no C++ compiler)" in caplog.text


def test_the_flat_step_compiles_only_on_the_kernel_path(flat_compiled, gpt2_dir):
    """The compiled flat step is the CPU's fixed-order kernel path (int4/int8 models: a float32 pool read in place);
    a float32 model attends by SDPA over each chunk (a loop over the step's chunks) and keeps its eager flat step."""
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.model.runner import ModelRunner, eos_ids

    worker, _ = flat_compiled
    assert worker.runner.flat_compiles()
    loaded = load_model(LoadConfig(model=str(gpt2_dir), device="cpu"))
    runner = ModelRunner(loaded.model, loaded.tokenizer, eos_ids(loaded.model, loaded.tokenizer))
    assert not runner.flat_compiles()
    assert not runner.compile_flat([], []) and runner.compiled_flat is None


@pytest.mark.slow
def test_the_embedded_default_compiled_answers_as_its_plain_forward_on_every_path(saker_cache, monkeypatch):
    """The default configuration as served (``Worker.from_settings``: the embedded SmolLM2 int4) with
    ``SAKER_COMPILE=true`` (its flat step compiled) answers a chat prompt as a plain greedy loop over the same modules
    does (each step one eager forward of the whole sequence, no cache, no engine; the log-softmax in float64):
    prefilled whole, in chunks
    of 7, 16 and 32, from the prefix cache, and beside other requests whose decode rows its chunks ride with (the
    checks of tests/engine/test_path_invariance.py, on the compiled step). Tokens equal, logprobs within 1e-5."""
    from app.engine.core.worker import Worker

    worker = Worker.from_settings(make_settings(cache_dir=str(saker_cache), compile=True))
    worker.load()
    assert "int4" in worker.info.precision and worker.runner.compiled_flat is not None
    messages = [
        {"role": "system", "content": "You are a careful assistant. Answer in one short sentence, with no preamble."},
        {"role": "user", "content": "what is 1+1? please provide the result without any other text."},
    ]
    tok = worker.tokenizer
    prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    ids, want = list(prompt), []
    with torch.inference_mode():
        for _ in range(8):
            logprobs = torch.log_softmax(worker.runner.model(input_ids=torch.tensor([ids])).logits[0, -1].double(), -1)
            want.append((int(logprobs.argmax()), float(logprobs.max())))
            ids.append(want[-1][0])
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    scheduler = worker.engine.scheduler

    def answers_as_the_reference():
        [output], _ = worker.complete([prompt], params, worker.info.context_length)
        choice = output.choices[0]
        assert choice.token_ids == [token for token, _ in want]
        assert choice.logprobs.token_logprobs == pytest.approx([lp for _, lp in want], abs=1e-5)

    monkeypatch.setattr(scheduler, "prefill_chunk_tokens", scheduler.prefill_chunk_tokens)  # put back after
    for chunk in (0, 7, 16, 32):
        worker.prefix_cache.clear_cached()
        scheduler.prefill_chunk_tokens = chunk
        answers_as_the_reference()
    reused = worker.prefix_cache.reused_tokens
    answers_as_the_reference()  # from the prefix cache
    assert worker.prefix_cache.reused_tokens > reused
    worker.prefix_cache.clear_cached()
    scheduler.prefill_chunk_tokens = 16
    others = [tok.encode("Write a short poem about the sea and the sky at night."), tok.encode("List primes: ") * 6]
    sampled = SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)
    length = worker.info.context_length
    threads = [threading.Thread(target=worker.complete, args=([o], sampled, length)) for o in others]
    for thread in threads:
        thread.start()
    try:
        while not worker.engine.batch.groups and any(thread.is_alive() for thread in threads):
            time.sleep(0.01)  # the others decode before the prompt comes: its chunks ride in their steps
        answers_as_the_reference()
    finally:
        for thread in threads:
            thread.join()
    assert worker.engine.max_rows_seen > 1
