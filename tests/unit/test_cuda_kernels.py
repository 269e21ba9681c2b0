"""saker's CUDA kernel (``app/engine/model/cuda_kernels.py``, Triton): one query per row over the block pool, against a
float64 attention written here. Without a GPU the kernel runs in Triton's interpreter (numpy, on the CPU), and the
engine's decode steps are run through it on the tests' tiny Llama and checked against a plain forward; on a GPU the
same checks run compiled, and once inside ``torch.compile`` (the way a CUDA graph holds it).

Triton is not in PyTorch's CPU build: requirements-dev.txt installs it for these tests."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from app.engine.model import cuda_kernels  # noqa: E402
from app.engine.core.blocks import BLOCK  # noqa: E402
from references import pool_attention  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BLOCKS = 48


@pytest.fixture(scope="module")
def jitted():
    """The kernel as the engine runs it: compiled on a GPU, interpreted here (``TRITON_INTERPRET``, which
    tests/conftest.py sets without a GPU before anything imports Triton)."""
    import os

    if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton was imported before TRITON_INTERPRET was set")
    return cuda_kernels.kernel()


@pytest.mark.parametrize(
    "heads, kv_heads, dim, dtype",
    [(6, 2, 64, torch.float32), (4, 4, 32, torch.float32), (8, 2, 80, torch.float32), (4, 1, 64, torch.bfloat16)],
)
@pytest.mark.parametrize("per_head", [False, True])
def test_rows_read_in_place_equal_float64_attention(jitted, heads, kv_heads, dim, dtype, per_head):
    """Grouped and plain multi-head attention, a head dim that is not a power of two, a bfloat16 pool; rows of
    several lengths (within one loop tile, across tiles, from a block's middle), sliding windows, a row that sees
    nothing (zeros), rows sharing a table; a program per kv head's group of query heads, and one per query head."""
    gen = torch.Generator().manual_seed(heads * dim)
    keys = torch.randn(BLOCKS * BLOCK, kv_heads, dim, generator=gen).to(dtype)
    values = torch.randn(BLOCKS * BLOCK, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.stack([torch.randperm(BLOCKS - 1, generator=gen)[:14] + 1 for _ in range(3)])
    which = torch.tensor([0, 1, 2, 2, 0, 1])
    hi = torch.tensor([1, 17, 100, 223, 64, 40])
    lo = torch.tensor([0, 0, 37, 200, 64, 8])
    q = torch.randn(len(hi), heads, dim, generator=gen).to(dtype)
    on = [t.to(DEVICE) for t in (q, keys, values, tables, which, lo, hi)]
    out = cuda_kernels.decode_attention(*on, 0.125, jitted=jitted, per_head=per_head).cpu()
    assert out.dtype == dtype and out.shape == q.shape
    tolerance = 2e-6 if dtype == torch.float32 else 2e-2
    for i in range(len(hi)):
        expected = pool_attention(q[i], keys, values, tables[which[i]], int(lo[i]), int(hi[i]), 0.125)
        torch.testing.assert_close(out[i].double(), expected, atol=tolerance, rtol=tolerance)
    assert not out[4].any()  # lo == hi


@pytest.mark.skipif(not CUDA, reason="torch.compile of a Triton kernel needs a GPU")
def test_the_kernel_compiles_inside_a_full_graph():
    keys = torch.randn(BLOCKS * BLOCK, 2, 64, device="cuda")
    values = torch.randn_like(keys)
    tables = torch.arange(1, 9, device="cuda").view(2, 4)
    which, lo, hi = (torch.tensor(x, device="cuda") for x in ([0, 1], [0, 0], [50, 9]))
    q = torch.randn(2, 4, 64, device="cuda")

    def step(q, keys, values, tables, which, lo, hi):
        return cuda_kernels.decode_attention(q * 2, keys, values, tables, which, lo, hi, 0.1) + 1

    compiled = torch.compile(step, fullgraph=True)
    args = (q, keys, values, tables, which, lo, hi)
    torch.testing.assert_close(compiled(*args), step(*args))


@pytest.mark.parametrize("speculative", [False, True])
def test_engine_decode_steps_through_the_kernel_equal_a_plain_forward(
    jitted, llama_dir, reference, monkeypatch, speculative
):
    """The engine with the kernel for its decode rows (batched decode steps, and decode rows beside a prompt's
    chunks in a flat step; with speculative decoding, rows that check guesses, one query per guessed position): each
    greedy token is a plain float32 forward's argmax and its logprob that forward's log-softmax within 1e-4 (1e-3
    on a GPU, whose float32 products differ from the CPU's). Here the kernel is interpreted on the CPU; on a GPU it
    is the compiled one."""

    from app.engine.params import SamplingParams

    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    real = cuda_kernels.decode_attention
    monkeypatch.setattr(cuda_kernels, "available", lambda device: True)
    monkeypatch.setattr(cuda_kernels, "decode_attention", counted)
    monkeypatch.setitem(cuda_kernels._state, "kernel", jitted)
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.core.worker import Worker

    from app.engine.core.speculative import SpeculativeConfig

    loaded = load_model(LoadConfig(model=str(llama_dir), device=DEVICE, dtype="float32"))
    extra = {"speculative": SpeculativeConfig("ngram", 4, 8, 1, 3)} if speculative else {}
    # the long prompt's chunks beside decode rows
    worker = Worker.from_loaded(("m",), loaded, prefill_chunk_tokens=8, **extra)
    model, tok = reference(llama_dir)
    prompts = [tok("Once upon a time").input_ids, tok("The quick brown fox jumps over the lazy dog " * 3).input_ids]
    params = SamplingParams(max_tokens=12 if speculative else 6, temperature=0.0, logprobs=1, ignore_eos=True, n=2)
    outputs, timings = worker.complete(prompts, params, 256)
    assert calls and max(calls) > 1  # rows went through the kernel, several at a time
    if speculative:
        assert timings.draft_tokens > 0 and max(calls) > 4  # the rows' guessed positions too
    for ids, output in zip(prompts, outputs):
        for choice in output.choices:
            got = choice.logprobs.token_logprobs
            full = ids + list(choice.token_ids)
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([full])).logits[0].double(), -1)
            for k, token in enumerate(choice.token_ids):
                row = lp[len(ids) - 1 + k]
                assert token == int(row.argmax()), k
                assert got[k] == pytest.approx(float(row[token]), abs=1e-3 if CUDA else 1e-4)  # the GPU's fp32


# -- fixed order (SAKER_BATCH_INVARIANT) ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_fixed_order_linear_gives_a_row_the_same_bits_whatever_the_other_rows(jitted, dtype, bias):
    """``cuda_kernels.linear`` is ``x @ W.T + b`` (a float64 product's value to the dtype's rounding), and a row's
    result is the same bits computed alone, among a few rows or among many (rows across two row tiles, an inner size
    that is not a multiple of the tile's)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 150, generator=gen).to(dtype)
    w = (torch.randn(70, 150, generator=gen) / 10).to(dtype)
    b = torch.randn(70, generator=gen).to(dtype) if bias else None

    def run(x):
        return cuda_kernels.linear(x.to(DEVICE), w.to(DEVICE), None if b is None else b.to(DEVICE)).cpu()

    full = run(x)
    assert full.dtype == dtype and full.shape == (37, 70)
    expected = x.double() @ w.double().T + (b.double() if bias else 0.0)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(full.double(), expected, atol=tolerance, rtol=tolerance)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 8), slice(16, 37)):
        assert torch.equal(run(x[rows]), full[rows]), rows
    assert torch.equal(run(x.view(1, 37, 150))[0], full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_order_rms_norm_is_llamas_norm_row_by_row(jitted, dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(5)
    norm = LlamaRMSNorm(96, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=gen))
    norm = norm.to(dtype)
    x = (3 * torch.randn(9, 96, generator=gen)).to(dtype)

    def run(x):
        return cuda_kernels.rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), norm.variance_epsilon).cpu()

    got = run(x)
    with torch.no_grad():
        want = norm(x)
    assert got.dtype == want.dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # an ulp of the rounded normalized value, times the weight
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance * 4, rtol=tolerance)
    assert torch.equal(run(x[4:5]), got[4:5]) and torch.equal(run(x[2:7]), got[2:7])


def test_fixed_order_speculation_gives_the_unspeculated_bits(jitted, llama_dir, reference, monkeypatch):
    """With the model in fixed order (``optimize.make_batch_invariant``), a row's guessed positions are computed with
    the numbers its plain steps would have: an oracle's guesses (the unspeculated answer) are all kept, and every
    token, logprob and top logprob is the same bits as without speculation, for two prompts (one prefilled in
    chunks beside the other's decoding). Here the kernels run in Triton's interpreter on float32; on a GPU compiled,
    where cuBLAS would otherwise give a row other bits in a wider step.

    Oracles: for the answers, transformers' own model (a plain forward's argmax and log-softmax,
    ``references.check_reference``); for the bits, the unspeculated answer itself (the subject is that speculation
    changes no bit, which no independent reference can show)."""
    import torch._inductor.config as inductor_config

    from app.engine.model import optimize
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.params import SamplingParams
    from app.engine.core.speculative import Speculation
    from app.engine.core.worker import Worker
    from references import Oracle, check_reference

    monkeypatch.setattr(cuda_kernels, "available", lambda device: True)
    monkeypatch.setitem(cuda_kernels._state, "kernel", jitted)
    monkeypatch.setitem(cuda_kernels._state, "fixed_order", False)  # the pass turns it on; restored after the test
    monkeypatch.setattr(inductor_config, "emulate_precision_casts", False)
    products = []
    real = cuda_kernels.linear
    monkeypatch.setattr(cuda_kernels, "linear", lambda x, *a: products.append(x.shape[0]) or real(x, *a))

    def worker(speculation=None):
        loaded = load_model(LoadConfig(model=str(llama_dir), device=DEVICE, dtype="float32", speculative="off"))
        assert optimize.make_batch_invariant(loaded.model, force=True) == 2 * 7 + 1 + 2 * 2 + 1
        assert optimize.make_batch_invariant(loaded.model, force=True) == 0  # once only
        made = Worker.from_loaded(("m",), loaded, prefill_chunk_tokens=8)
        made.engine.batch.speculation = speculation
        return made

    tok = __import__("transformers").AutoTokenizer.from_pretrained(llama_dir)
    prompts = [tok("red green blue red green blue red").input_ids, tok("The quick brown fox " * 4).input_ids]
    params = SamplingParams(max_tokens=14, temperature=0.0, logprobs=2, ignore_eos=True)
    plain, _ = worker().complete(prompts, params, 256)
    assert cuda_kernels.fixed_order() and max(products) > 1
    model, _ = reference(llama_dir)
    for ids, output in zip(prompts, plain):
        check_reference(output, model, tok, ids, params, tol=1e-3 if CUDA else 1e-4)
    answers = {tuple(p): list(o.choices[0].token_ids) for p, o in zip(prompts, plain)}
    speculation = Speculation(Oracle(answers, 10_000), 4, 8)
    got, _ = worker(speculation).complete(prompts, params, 256)
    assert speculation.draft_tokens > 0 and speculation.accepted_tokens == speculation.draft_tokens
    for a, b in zip(got, plain):
        x, y = a.choices[0], b.choices[0]
        assert x.token_ids == y.token_ids
        assert x.logprobs.token_logprobs == y.logprobs.token_logprobs  # the same bits, not approximately
        assert x.logprobs.top_logprobs == y.logprobs.top_logprobs


class _Launch:
    """A stand-in for a jitted kernel that dynamo can trace on the CPU: ``launch[grid](*args, **meta)`` runs
    ``body(*args)``, plain tensor operations writing the kernel's output argument."""

    def __init__(self, body):
        self.body = body

    def __getitem__(self, grid):
        return self.body


def test_the_kernels_wrappers_trace_into_one_full_graph(monkeypatch):
    """What runs around each launch (the output's allocation, its dtype, the grid, the launch's constants) must be
    traceable by dynamo, or a compiled step with the fixed-order kernels fails at start-up, as the first GPU run of
    ``SAKER_BATCH_INVARIANT`` under ``torch.compile`` did (``torch.result_type`` returns no tensor). The Triton
    launches themselves are stood in for here, since dynamo traces a Triton kernel only on a GPU; there
    ``test_the_kernel_compiles_inside_a_full_graph`` and the engine's compiled tests compile the real ones."""

    def linear_body(x, w, b, out, *rest, HAS_BIAS, **meta):
        out.copy_(x @ w.T + (b if HAS_BIAS else 0))

    def norm_body(x, w, out, *rest, **meta):
        out.copy_(w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + rest[-1])))

    def attention_body(q, *rest, **meta):
        rest[6].copy_(q * 2)

    monkeypatch.setitem(cuda_kernels._state, "linear", _Launch(linear_body))
    monkeypatch.setitem(cuda_kernels._state, "rms_norm", _Launch(norm_body))
    monkeypatch.setitem(cuda_kernels._state, "kernel", _Launch(attention_body))
    gen = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(3, 8, generator=gen), torch.randn(6, 8, generator=gen), torch.randn(6, generator=gen)
    norm_w = torch.randn(8, generator=gen)
    q = torch.randn(3, 4, 16, generator=gen)
    pool = torch.randn(BLOCKS * BLOCK, 2, 16, generator=gen)
    tables = torch.arange(1, 9).view(2, 4)
    which, lo, hi = torch.tensor([0, 1, 1]), torch.tensor([0, 0, 0]), torch.tensor([5, 9, 9])

    def step(x, w, b, norm_w, q):
        h = cuda_kernels.rms_norm(cuda_kernels.linear(cuda_kernels.linear(x, w, b), w.T), norm_w, 1e-5)
        return h, cuda_kernels.decode_attention(q, pool, pool, tables, which, lo, hi, 0.1)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    for got, want in zip(compiled(x, w, b, norm_w, q), step(x, w, b, norm_w, q)):
        torch.testing.assert_close(got, want)
