"""Inference rewrites keep the model's numbers: compared with the untouched module on the same inputs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from app.engine.model.optimize import PackedLinear, fuse_gelu_tanh, optimize_for_inference, pack_linears_onednn


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_linear(bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 300, bias=bias)
    fast = PackedLinear.from_module(linear)
    for shape in [(1, 1, 48), (3, 5, 48), (7, 48), (8, 1, 48)]:
        x = torch.randn(*shape)
        out = fast(x)
        assert out.shape == linear(x).shape
        assert torch.allclose(out, linear(x), atol=1e-5)
    x = torch.randn(5, 48).t().contiguous().t()  # a non-contiguous input
    assert torch.allclose(fast(x), linear(x), atol=1e-5)
    assert (fast.in_features, fast.out_features) == (48, 300)
    assert not hasattr(fast, "weight")


def test_packed_conv1d_equals_conv1d():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = Conv1D(96, 32)  # GPT-2's layout: weight (in=32, out=96)
    torch.nn.init.normal_(conv.bias)
    fast = PackedLinear.from_module(conv)
    x = torch.randn(2, 3, 32)
    assert torch.allclose(fast(x), conv(x), atol=1e-5)


def test_rewrites_keep_gpt2_logits(gpt2_dir):
    from transformers import AutoModelForCausalLM
    from transformers.activations import NewGELUActivation
    from transformers.pytorch_utils import Conv1D

    model = AutoModelForCausalLM.from_pretrained(str(gpt2_dir), dtype=torch.float32).eval()
    original = copy.deepcopy(model)
    conv1d = sum(isinstance(m, Conv1D) for m in model.modules())
    assert conv1d == 4 * model.config.n_layer and any(isinstance(m, NewGELUActivation) for m in model.modules())
    assert optimize_for_inference(model) == ["fused tanh GELU"]  # tiny matrices stay as they are
    assert pack_linears_onednn(model, min_elements=0) == conv1d + 1
    assert isinstance(model.get_output_embeddings(), PackedLinear)
    assert not any(isinstance(m, (Conv1D, nn.Linear, NewGELUActivation)) for m in model.modules())
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, original(ids).logits, atol=1e-4)
    assert isinstance(model.get_input_embeddings(), nn.Embedding)  # the embedding is left as it was
    assert pack_linears_onednn(model, min_elements=0) == 0 and fuse_gelu_tanh(model) == 0  # idempotent


def test_llama_linears_packed_and_logits_kept(llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    original = copy.deepcopy(model)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert linears == 7 * model.config.num_hidden_layers + 1
    assert optimize_for_inference(model) == []
    assert pack_linears_onednn(model, min_elements=64 * 128) == 3 * model.config.num_hidden_layers + 1  # MLP, head
    assert pack_linears_onednn(model, min_elements=0) == 4 * model.config.num_hidden_layers  # q, k, v, o
    ids = torch.tensor([[1, 40, 41, 42]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, original(ids).logits, atol=1e-4)


def test_packing_left_out_for_other_dtypes(llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.bfloat16).eval()
    assert pack_linears_onednn(model, min_elements=0) == 0
    assert any(type(m) is nn.Linear for m in model.modules())


def test_packing_reverted_when_its_check_fails(llama_dir, monkeypatch, caplog):
    """A packed forward that disagrees with the original puts every original module back."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    modules = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
    real_forward = PackedLinear.forward
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: real_forward(self, x) * 1.01)
    with caplog.at_level("WARNING", logger="saker.optimize"):
        assert pack_linears_onednn(model, min_elements=0) == 0
    assert "not applied" in caplog.text and "logits moved" in caplog.text
    assert {name: m for name, m in model.named_modules() if type(m) is nn.Linear} == modules
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


def test_packing_reverted_when_forward_raises(gpt2_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gpt2_dir), dtype=torch.float32).eval()

    def broken(self, x):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(PackedLinear, "forward", broken)
    assert pack_linears_onednn(model, min_elements=0) == 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
