"""Raw logprobs: the float32 log-softmax of the logits, its normaliser exact to float32 rounding."""

from __future__ import annotations

import torch

from app.engine.model import cpu_kernels


FLOAT64_ELEMENTS = 1 << 22  # the float64 log-softmax's rows at a time: at most 32 MB of float64 beside the logits


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """The model's own distribution: no temperature, penalties, filters or biases (``log_softmax``)."""
    return log_softmax(logits)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """The log-softmax of ``x`` over its last dim, in float32. On the CPU exact to float32 rounding (within 5e-7):
    saker's kernel (``cpu_kernels.log_softmax``: the normaliser summed in float64 in a fixed order, the same bits
    on every CPU that runs it and for a row alone or among others), or where it is not built PyTorch's
    log-softmax in float64 (a slice of rows at a time), rounded once. Not PyTorch's float32 one: it sums in one
    vector's lanes and drops the small terms, by an amount that depends on the lane count (up to 3.7e-5 on the
    embedded model's logprobs on AVX2). On CUDA PyTorch's own, as before (not measured here)."""
    x = x.float()
    if x.device.type != "cpu":
        return torch.log_softmax(x, dim=-1)
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    if cpu_kernels.kernel() is not None:
        return cpu_kernels.log_softmax(rows).view(shape)
    out = torch.empty_like(rows)
    step = max(1, FLOAT64_ELEMENTS // max(1, shape[-1]))
    for start in range(0, rows.shape[0], step):
        out[start : start + step] = torch.log_softmax(rows[start : start + step].double(), dim=-1)
    return out.view(shape)
