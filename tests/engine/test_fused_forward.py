"""saker's own forward of Llama-shaped decoders on the CPU (``app/engine/model/fused_forward.py``) and its kernels
(``kernels/decoder_ops.cpp``), against transformers' own modules and functions, not against another engine path:

- RMSNorm, the residual stream's add and the rotary embedding are transformers' arithmetic to the bit, and a row's
  results do not depend on the rows beside it;
- an int4 tiny Llama served by the engine runs every step through the fused forward, and its answers are the plain
  transformers forward's (argmax and log-softmax within 1e-4, greedy tokens those of ``generate()``), alone,
  chunked, beside other requests;
- a model it does not know keeps transformers' forward."""

from __future__ import annotations

import pytest
import torch

from app.engine.model import cpu_kernels, fused_forward
from references import check_served, serve_alone_and_beside

pytestmark = pytest.mark.skipif(not cpu_kernels.supports(64), reason="the CPU kernels cannot be built here")


@pytest.mark.parametrize("dim", [64, 100, 576, 960, 2048, 4104])
def test_rms_norm_is_transformers_rmsnorm_and_each_row_its_own(dim):
    """To the bit, for row sizes that leave whole and partial cascades, vectors and elements in PyTorch's sum (whose
    order the kernel reproduces where PyTorch's capability is AVX2 or AVX512, ``cpu_kernels.sums_in_order``, and
    calls elsewhere: both ways are checked)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(dim)
    norm = LlamaRMSNorm(dim, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim))
    x = torch.randn(37, dim) * torch.logspace(-3, 2, 37).view(-1, 1)  # rows of very different sizes
    with torch.no_grad():
        want = norm(x)
    in_order = cpu_kernels.sums_in_order()
    got = cpu_kernels.rms_norm(x, norm.weight.detach(), norm.variance_epsilon, in_order)
    # the bits: a float32 mean of squares summed in another order (or in float64) moved the embedded int4 model's
    # logprobs by up to 4.6e-4 (an ulp crossing the int4 kernel's int16 rounding of its inputs)
    assert torch.equal(got, want)
    assert torch.equal(cpu_kernels.kernel().rms_norm(x, norm.weight.detach(), 1e-5, False), want)
    for i in (0, 5, 36):
        assert torch.equal(cpu_kernels.rms_norm(x[i : i + 1], norm.weight.detach(), 1e-5, in_order)[0], got[i])


def test_add_rms_norm_adds_to_the_bit_and_normalises_the_sum():
    torch.manual_seed(1)
    x, residual, weight = torch.randn(9, 64), torch.randn(9, 64), torch.randn(64)
    normed, total = cpu_kernels.add_rms_norm(x, residual, weight, 1e-6, True)
    assert torch.equal(total, residual + x)
    assert torch.equal(normed, cpu_kernels.rms_norm(residual + x, weight, 1e-6, True))
    with pytest.raises(RuntimeError, match="residual like x"):
        cpu_kernels.add_rms_norm(x, residual[:3], weight, 1e-6, True)


@pytest.mark.parametrize("dim", [16, 64, 128])
def test_rotary_write_is_transformers_rotation_and_writes_the_pool(dim):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(2)
    tokens, hq, hkv, slots = 7, 6, 2, 40
    q, k, v = torch.randn(tokens, hq, dim), torch.randn(tokens, hkv, dim), torch.randn(tokens, hkv, dim)
    angles = torch.randn(tokens, dim // 2) * 30
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    keys, values = torch.zeros(slots, hkv, dim), torch.zeros(slots, hkv, dim)
    write = torch.tensor([3, 17, 4, 39, 0, 21, 8])
    got = cpu_kernels.rotary_write(q, k, v, cos, sin, keys, values, write)
    # transformers' layout: (batch, heads, tokens, dim) with cos, sin (batch, tokens, dim)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(got, want_q[0].transpose(0, 1))
    assert torch.equal(keys[write], want_k[0].transpose(0, 1))
    assert torch.equal(values[write], v)
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[write] = False
    assert not keys[untouched].any() and not values[untouched].any()
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_kernels.rotary_write(q, k, v, cos, sin, keys, values, write + slots)


def tiny_decoder(llama_dir, root, kind: str):
    """The tests' tiny Llama, or a tiny Mistral (no sliding window) or Qwen2 (its q, k, v biases drawn, not
    zero) of the same shape and tokenizer."""
    if kind == "llama":
        return llama_dir
    from transformers import AutoTokenizer

    from tooling.tiny_models import llama_model

    path = root / kind
    tok = AutoTokenizer.from_pretrained(llama_dir)
    model = llama_model(tok, kind=kind, seed=1, **({"sliding_window": None} if kind == "mistral" else {}))
    with torch.no_grad():
        for layer in model.model.layers:
            for name in ("q_proj", "k_proj", "v_proj"):
                bias = getattr(layer.self_attn, name).bias
                if bias is not None:
                    bias.normal_(0.0, 0.2)
    tok.save_pretrained(path)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=fused_forward.MODEL_TYPES)
def fused(request, llama_dir, tmp_path_factory):
    """Each tiny decoder the fused forward knows (Llama, Mistral, Qwen2) served int4 (its flat steps by the fused
    forward), prompts in chunks of 8, up to 4 rows; and the same int4 model loaded again outside any engine, its
    own attention as served (the oracle)."""
    from app.engine.core.worker import Worker
    from app.engine.model.attention import use_engine_attention
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model

    root = tmp_path_factory.mktemp("fused")
    model_dir = tiny_decoder(llama_dir, root, request.param)
    config = LoadConfig(model=str(model_dir), quantize="int4", cache_dir=str(root / "cache"))
    worker = Worker.from_loaded(
        ("m",), load_model(config), max_batch_rows=4, prefill_chunk_tokens=8, prefix_cache_tokens=0
    )
    plain = load_model(config).model
    assert use_engine_attention(plain) and plain.config.model_type == request.param
    biased = plain.model.layers[0].self_attn.q_proj.bias is not None
    assert biased == (request.param == "qwen2")  # Qwen2's products with biases go through their modules
    return worker, plain


def served_through_fused(worker, monkeypatch) -> list[tuple]:
    """``references.serve_alone_and_beside`` with ``fused_forward.forward`` counted and transformers' forward made
    to fail: the requests as served, every step through the fused forward, decode rows alone and wider steps."""
    calls, real = [], fused_forward.forward

    def counted(plan, tokens, *args, **kwargs):
        calls.append(tokens.shape[0])
        return real(plan, tokens, *args, **kwargs)

    def transformers_forward(*args, **kwargs):
        raise AssertionError("a step ran transformers' forward")

    monkeypatch.setattr(fused_forward, "forward", counted)
    monkeypatch.setattr(worker.runner.model, "forward", transformers_forward)
    served = serve_alone_and_beside(worker)
    monkeypatch.undo()  # the oracle is the same class's plain forward
    assert 1 in calls and max(calls) > 1  # decode rows alone, and wider steps
    return served


def test_every_step_runs_the_fused_forward_and_answers_as_the_plain_forward(fused, monkeypatch):
    """A request alone, then a long prompt's chunks beside requests decoding (mixed steps, rows joining and
    leaving): every forward is the fused one (transformers' model is not called by a step), and every answer is
    the plain forward's: its argmax and log-softmax within 1e-4, the greedy tokens of its ``generate()``."""
    worker, plain = fused
    assert worker.runner.fused is not None
    # Llama's and Mistral's int4 products run every layer in one call (``Plan.layers_call``); Qwen2's biased ones
    # through the Python loop: both paths are checked here
    assert (worker.runner.fused.layers_call is not None) == (plain.config.model_type != "qwen2")
    check_served(served_through_fused(worker, monkeypatch), plain, worker.tokenizer)


@pytest.fixture(scope="module")
def fused_gpt2(gpt2_dir):
    """The tests' tiny GPT-2 in float32 served (its steps by ``fused_forward``'s GPT-2 forward), prompts in chunks of
    8, up to 4 rows; and the same model loaded again outside any engine (the oracle: transformers' own forward)."""
    from app.engine.core.worker import Worker
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model

    config = LoadConfig(model=str(gpt2_dir), dtype="float32")
    worker = Worker.from_loaded(
        ("m",), load_model(config), max_batch_rows=4, prefill_chunk_tokens=8, prefix_cache_tokens=0
    )
    return worker, load_model(config).model


def test_a_float32_gpt2_steps_through_its_fused_forward_and_answers_as_the_plain_forward(fused_gpt2, monkeypatch):
    """Every step of a float32 GPT-2 (a request alone; a long prompt's chunks beside requests decoding, greedy and
    seeded) is the fused forward, not transformers' model, and every answer is the plain forward's (argmax and
    log-softmax within 1e-4, the greedy tokens of ``generate()``). And the fused forward's logits over one flat step
    are transformers' model's over the same step to the bit: the same operations in the same order."""
    from app.engine.model.attention import FlatStep

    worker, plain = fused_gpt2
    runner = worker.runner
    assert type(runner.fused) is fused_forward.GPT2Plan
    check_served(served_through_fused(worker, monkeypatch), plain, worker.tokenizer)

    # one flat step by hand: two decode rows over their blocks (in place) and a chunk of a third sequence
    layers = plain.config.n_layer
    heads, dim = plain.config.n_head, plain.config.n_embd // plain.config.n_head
    gen = torch.Generator().manual_seed(3)

    def pool():
        return [torch.randn(64 * 16, heads, dim, generator=gen) for _ in range(layers)]

    tokens = torch.tensor([11, 12, 5, 6, 7, 8])
    positions = torch.tensor([20, 33, 16, 17, 18, 19])
    gather = torch.tensor([[1, 2, 0], [3, 4, 5]])
    chunk = (torch.tensor([6, 7]), 16, 4)
    write = torch.tensor([1 * 16 + 4, 5 * 16 + 1, 7 * 16, 7 * 16 + 1, 7 * 16 + 2, 7 * 16 + 3])

    def both_ways():
        outs = []
        for fused in (True, False):
            gen.manual_seed(3)
            keys, values = pool(), pool()
            flat = FlatStep(keys, values, write, 2, gather, row_positions=positions[:2], chunks=(chunk,))
            runner.fused = fused_forward.plan(runner.model) if fused else None
            outs.append((runner._flat_logits(tokens, positions, flat, torch.tensor([0, 1, 5])), keys, values))
        runner.fused = fused_forward.plan(runner.model)
        (got, got_k, got_v), (want, want_k, want_v) = outs
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(got_k + got_v, want_k + want_v))

    both_ways()
    # a larger GPT-2's products are packed for oneDNN at load (``optimize.pack_linears_onednn``): the fused forward
    # calls those modules as transformers' forward does (this model's are packed here, whatever their size)
    from app.engine.model.optimize import PackedLinear, pack_linears_onednn

    assert pack_linears_onednn(runner.model, min_elements=0) > 0
    assert fused_forward.supports(runner.model, runner.kv_dtype)
    assert any(type(spec) is PackedLinear for spec in fused_forward.plan(runner.model).layers[0])
    both_ways()


def test_a_model_it_does_not_know_keeps_transformers_forward(gpt2_dir, llama_dir, tmp_path):
    """An int4 GPT-2 (its products quantized), and a float32 Llama (its attention SDPA's, not the float32
    kernel's), run transformers' forward; an int4 Llama with PEFT adapters would too (``supports``)."""
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.model.runner import ModelRunner, eos_ids

    for config in (
        LoadConfig(model=str(gpt2_dir), quantize="int4", cache_dir=str(tmp_path)),
        LoadConfig(model=str(llama_dir), dtype="float32"),
    ):
        loaded = load_model(config)
        runner = ModelRunner(loaded.model, loaded.tokenizer, eos_ids(loaded.model, loaded.tokenizer))
        assert runner.fused is None, config
    loaded = load_model(LoadConfig(model=str(llama_dir), quantize="int4", cache_dir=str(tmp_path)))
    runner = ModelRunner(loaded.model, loaded.tokenizer, eos_ids(loaded.model, loaded.tokenizer))
    assert runner.fused is not None
    assert not fused_forward.supports(loaded.model, runner.kv_dtype, adapters=("a",))
