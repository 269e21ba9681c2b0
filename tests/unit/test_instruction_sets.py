"""Every instruction-set path the code takes on the machine that runs the suite: a row's numbers are the same bits
whatever the width of the step that computes it, and raw logprobs are exact to float32 rounding.

PyTorch picks its CPU kernels when it is imported, by the best instruction set the CPU has
(``torch.backends.cpu.get_cpu_capability()``: AVX512 or AVX2 on x86); ``ATEN_CPU_CAPABILITY`` (``avx2``,
``default``) lowers that choice, so one machine can run each lower path. saker's own kernels
(``app/engine/model/kernels/``) are built ``-mavx2 -mfma`` on every x86 CPU, the int4 and int8 linears with AVX-512
paths taken where the CPU has AVX-512 VNNI and PyTorch runs AVX512 (lowered with it), and only where PyTorch runs
AVX2 or better: under ``default`` the fallbacks run (attention and the log-softmax in float64, the int8 LM head in
bfloat16). So the checks here run in this process (the CPU's own path) and, by
``test_each_lower_capability_passes_these_checks``, again in a subprocess under each lower capability the CPU has:
AVX2 and default on an AVX-512 machine, default on an AVX2 one. A difference that only one instruction set shows
fails on our machines, not first on a user's.

The width checks compare a row computed among ``WIDTHS`` rows with the same row computed alone, for every
operation the default configuration's forward is made of (the int4 and int8 linears, the int8 head, attention,
RMSNorm, rotary embeddings, the MLP's activation, bfloat16 rounding, the log-softmax), then a whole int4 model's
logits (a plain forward of L tokens against one of L + 5). The reference for the logprobs is float64.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.engine.model import cpu_kernels
from app.engine.sampling.logprobs import raw_logprobs
from test_cpu_kernels import assert_exact_to_float32, peaked_logits

ORDER = ["DEFAULT", "AVX2", "AVX512"]  # PyTorch's x86 capabilities, lowest first
FORCED = os.environ.get("ATEN_CPU_CAPABILITY")
WIDTHS = (1, 2, 3, 5, 8, 9, 17, 64, 200)
ROOT = Path(__file__).resolve().parents[2]


def capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


def lower_capabilities() -> list[str]:
    """The capabilities below the one this process runs (none when this run is itself one of them)."""
    if FORCED or capability() not in ORDER:
        return []
    return [c.lower() for c in ORDER[: ORDER.index(capability())]]


def same_bits_at_every_width(f, x: torch.Tensor) -> list[str]:
    """Where ``f(rows, start)`` (the rows at positions ``start, start + 1, ...``) gives a row other bits than it
    gives that row among all of ``x``'s: the first M rows (a prompt, a plain forward), a few rows further on (a
    speculative step's guesses, a prompt's chunk) and single rows (a decode step)."""
    whole = f(x, 0)
    bad = []

    def check(part: torch.Tensor, want: torch.Tensor, what: str) -> None:
        if not torch.equal(part, want):  # what differs, for a failure that does not come back on a rerun
            differ = part != want
            rows = differ.reshape(differ.shape[0], -1).any(-1).nonzero().view(-1).tolist()
            gap = (part.double() - want.double()).abs().max().item()
            bad.append(
                f"{what} (its rows {rows[:8]}{'...' if len(rows) > 8 else ''}: {int(differ.sum())} values, at most "
                f"{gap:.3g} apart; {torch.get_num_threads()} threads)"
            )

    for m in WIDTHS:
        if m < x.shape[0]:
            check(f(x[:m], 0), whole[:m], f"the first {m} rows")
    for start, count in ((5, 5), (100, 3), (x.shape[0] - 16, 16)):
        check(f(x[start : start + count], start), whole[start : start + count], f"{count} rows from {start}")
    for i in (0, 4, x.shape[0] - 1):
        check(f(x[i : i + 1], i), whole[i : i + 1], f"row {i} alone")
    return bad


def linear(kind: str):
    """An int4 / int8 linear (576 -> 1536) of fixed weights; "int8 head": the int8 linear as an LM head (float32
    logits by saker's kernel where it is built)."""
    from app.engine.model.quantize import Int4Linear, Int8Linear, mark_head

    weight = torch.randn(1536, 576, generator=torch.Generator().manual_seed(1)) * 0.05
    if kind == "int4":
        module = Int4Linear.from_weight(weight, None)
    else:
        module = Int8Linear(weight, None)
    if kind == "int8 head":
        owner = torch.nn.Module()
        owner.get_output_embeddings = lambda: module
        mark_head(owner)
        assert module.float_logits == (cpu_kernels.kernel() is not None)
    return lambda x, start: module(x[:, :576])


def attention():
    """Causal attention of the rows as queries (9 heads, 3 kv heads of 64) over fixed keys and values: the row at
    position p sees positions 0..p whatever the number of rows, through the fixed-order path an int4 model takes
    (the kernel, or float64 where it is not built)."""
    from types import SimpleNamespace

    from app.engine.model.attention import exact_attention

    generator = torch.Generator().manual_seed(2)
    keys = torch.randn(1, 3, 256, 64, generator=generator)
    values = torch.randn(1, 3, 256, 64, generator=generator)
    module = SimpleNamespace(is_causal=True)

    def run(x, start):
        count, end = x.shape[0], start + x.shape[0]
        q = x[:, :576].reshape(1, count, 9, 64).transpose(1, 2)  # the last queries of positions 0..end - 1
        out, _ = exact_attention(module, q, keys[:, :, :end], values[:, :, :end], None)
        return out.reshape(count, 576)

    return run


def rms_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(1536, eps=1e-5)
    norm.weight.data = torch.linspace(0.5, 1.5, 1536)
    return lambda x, start: norm(x)


def rotary():
    """Rotary embeddings at the rows' positions, cos and sin computed for those positions."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    embedding = LlamaRotaryEmbedding(LlamaConfig(hidden_size=576, num_attention_heads=9))

    def run(x, start):
        cos, sin = embedding(x, torch.arange(start, start + x.shape[0]).view(1, -1))
        q = x[:, :576].reshape(1, -1, 9, 64).transpose(1, 2)
        return apply_rotary_pos_emb(q, q, cos, sin)[0].transpose(1, 2).reshape(x.shape[0], 576)

    return run


OPERATIONS = {  # name -> a function of (rows (M, 1536) float32, the first row's position)
    "int4 linear": lambda: linear("int4"),
    "int8 linear": lambda: linear("int8"),
    "int8 LM head": lambda: linear("int8 head"),
    "attention": attention,
    "RMSNorm": rms_norm,
    "rotary embedding": rotary,
    "SiLU MLP": lambda: lambda x, start: torch.nn.functional.silu(x[:, :768]) * x[:, 768:],
    "bfloat16 rounding": lambda: lambda x, start: x.to(torch.bfloat16).float(),
    "log-softmax": lambda: lambda x, start: raw_logprobs(x * 4),
}


def test_pytorch_runs_the_capability_asked_and_the_kernels_follow_it():
    """Under ``ATEN_CPU_CAPABILITY`` PyTorch runs the path asked (a name it does not know, or one above the CPU's,
    would silently run another); saker's kernels are built where it is AVX2 or better (given a compiler, as
    tests/unit/test_cpu_kernels.py assumes) and never below."""
    if FORCED:
        assert capability() == FORCED.upper()
    if capability() not in ("AVX2", "AVX512"):
        assert cpu_kernels.kernel() is None
    elif cpu_kernels.kernel() is None:
        pytest.skip("the CPU kernels cannot be built here (no C++ compiler or ninja: see the log)")


@pytest.mark.parametrize("name", list(OPERATIONS))
def test_each_operation_gives_a_row_the_same_bits_at_every_width(name):
    torch.manual_seed(0)
    x = torch.randn(max(WIDTHS) + 7, 1536)
    with torch.inference_mode():
        assert same_bits_at_every_width(OPERATIONS[name](), x) == [], capability()


def test_an_int4_models_logits_at_a_position_do_not_depend_on_the_tokens_after_it():
    """A whole int4 model (Llama-shaped, tiny, the engine's attention registered as the server does): a plain
    forward of L tokens and one of L + 5 give the first L positions the same logits, bit for bit, so a position's
    numbers do not depend on how many tokens its forward computes (the speculative steps' guesses, chunks)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from app.engine.model.attention import use_engine_attention
    from app.engine.model.quantize import quantize_model

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval()
    quantize_model(model, "int4")
    assert use_engine_attention(model) and model.model.layers[0].self_attn._saker_exact
    ids = torch.randint(0, 512, (1, 150))
    with torch.inference_mode():
        whole = model(input_ids=ids).logits[0]
        for length in (1, 37, 145):
            assert torch.equal(model(input_ids=ids[:, :length]).logits[0], whole[:length]), length


@pytest.mark.parametrize("dim", [64, 100, 576, 960, 1536, 2048, 4104, 70000])
def test_the_norms_reproduce_pytorchs_sum_of_squares_under_this_capability(dim):
    """The fused forward's RMSNorm reproduces ``x.pow(2).mean(-1)`` to the bit where ``cpu_kernels.sums_in_order``
    says so (AVX2 and AVX512: ATen's sum has no AVX-512 variant, so its 8-lane order is the same under both), for
    row sizes that leave whole and partial cascades, vectors and elements; run again under each lower capability."""
    if cpu_kernels.kernel() is None or not cpu_kernels.sums_in_order():
        pytest.skip(f"the norms call PyTorch's sum here ({capability()})")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(dim)
    norm = LlamaRMSNorm(dim, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim))
    x = torch.randn(5, dim) * torch.logspace(-3, 2, 5).view(-1, 1)
    with torch.no_grad():
        assert torch.equal(cpu_kernels.rms_norm(x, norm.weight.detach(), 1e-5, True), norm(x))


def test_raw_logprobs_are_exact_to_float32_rounding():
    """The logprobs the sampler reports (and echo's): the float64 log-softmax of the logits rounded to float32, on
    a vocabulary of the embedded model's size with a peaked distribution (PyTorch's float32 log-softmax: 4.8e-5 off
    on an AVX2 CPU)."""
    from app.engine.params import SamplingParams
    from app.engine.sampling.sampler import RowSpec, SamplingRows, sample

    logits = peaked_logits(24, 49152)
    assert_exact_to_float32(raw_logprobs(logits), logits)
    spec = RowSpec.of(SamplingParams(temperature=0.0, logprobs=3), (), True)
    tokens, numbers = sample(logits, SamplingRows.for_prompt(spec, list(range(len(logits))), [], 49152, "cpu"))
    exact = torch.log_softmax(logits.double(), -1)
    want = exact.gather(1, tokens.view(-1, 1)).view(-1)
    assert numbers.logprobs == pytest.approx(want.tolist(), abs=5e-7, rel=0)


@pytest.mark.slow
@pytest.mark.parametrize("lower", lower_capabilities() or [None])
def test_each_lower_capability_passes_these_checks(lower):
    """This file again, in a fresh interpreter whose PyTorch runs ``lower`` (AVX2 on an AVX-512 CPU, default)."""
    if lower is None:
        pytest.skip(f"no capability below {capability()} to force here (or this run is one)")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": lower}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, f"under ATEN_CPU_CAPABILITY={lower}:\n{run.stdout[-6000:]}\n{run.stderr[-3000:]}"
