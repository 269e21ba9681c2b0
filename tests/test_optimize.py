"""Inference rewrites keep the model's numbers: compared with the untouched module on the same inputs."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from app.engine.optimize import TransposedLinear, fuse_gelu_tanh, optimize_for_inference, transpose_lm_head


@pytest.mark.parametrize("bias", [False, True])
def test_transposed_linear_equals_linear(bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 300, bias=bias)
    fast = TransposedLinear(linear)
    for shape in [(1, 1, 48), (3, 5, 48), (7, 48)]:
        x = torch.randn(*shape)
        assert torch.allclose(fast(x), linear(x), atol=1e-5)
    assert fast.weight.shape == linear.weight.shape


def test_rewrites_keep_gpt2_logits(gpt2_dir):
    from transformers import AutoModelForCausalLM
    from transformers.activations import NewGELUActivation
    model = AutoModelForCausalLM.from_pretrained(str(gpt2_dir), dtype=torch.float32).eval()
    original = copy.deepcopy(model)
    assert any(isinstance(m, NewGELUActivation) for m in model.modules())
    assert optimize_for_inference(model) == ["transposed LM head", "fused tanh GELU"]
    assert isinstance(model.get_output_embeddings(), TransposedLinear)
    assert not any(isinstance(m, NewGELUActivation) for m in model.modules())
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, original(ids).logits, atol=1e-4)
    assert isinstance(model.get_input_embeddings(), nn.Embedding)     # the embedding is left as it was
    assert transpose_lm_head(model) is False and fuse_gelu_tanh(model) == 0    # idempotent


def test_llama_head_is_transposed_and_logits_kept(llama_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    original = copy.deepcopy(model)
    assert optimize_for_inference(model) == ["transposed LM head"]
    ids = torch.tensor([[1, 40, 41, 42]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, original(ids).logits, atol=1e-4)
