"""Inference-only rewrites of a loaded model that keep its numbers (to float rounding) and save time.

Each pass checks that it applies and leaves the model alone otherwise:

- ``transpose_lm_head``: on CPU, the output layer's weight is kept as (hidden, vocab) and applied with ``addmm``.
  MKL's single-row GEMM on that layout is ~1.6x faster than ``F.linear`` on (vocab, hidden); the LM head is the
  largest matrix of a small model, so this is ~8% of a decode step for GPT-2 small. A tied head keeps the
  embedding as it was and adds the transposed copy (vocab x hidden floats more memory).
- ``fuse_gelu_tanh``: transformers' ``NewGELUActivation`` (GPT-2's "gelu_new", eight element-wise ops) becomes
  PyTorch's fused ``GELU(approximate="tanh")``, the same function.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("saker.optimize")


class TransposedLinear(nn.Module):
    """A bias-free or biased Linear whose weight is stored transposed, (in, out), and applied with addmm."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        """The (out, in) view, for code that reads ``lm_head.weight`` (shape, dtype, device)."""
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.addmm(self.bias, rows, self.weight_t) if self.bias is not None else rows.mm(self.weight_t)
        return out.view(*x.shape[:-1], self.out_features)


def transpose_lm_head(model: nn.Module) -> bool:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear or head.weight.device.type != "cpu" or head.weight.dtype != torch.float32:
        return False
    if getattr(model, "hf_device_map", None) or getattr(model, "peft_config", None):
        return False
    model.set_output_embeddings(TransposedLinear(head))
    return True


def fuse_gelu_tanh(model: nn.Module) -> int:
    from transformers.activations import NewGELUActivation
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is NewGELUActivation:
                setattr(parent, name, nn.GELU(approximate="tanh"))
                count += 1
    return count


def optimize_for_inference(model: nn.Module) -> list[str]:
    """Apply every pass that fits; the names of those applied (logged)."""
    applied = []
    if transpose_lm_head(model):
        applied.append("transposed LM head")
    if fuse_gelu_tanh(model):
        applied.append("fused tanh GELU")
    if applied:
        log.info("inference rewrites: %s", ", ".join(applied))
    return applied
