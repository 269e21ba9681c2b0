"""Inference-only rewrites of a loaded model that keep its numbers (to float rounding) and save time.

Each pass checks that it applies and leaves the model alone otherwise:

- ``pack_linears_onednn``: on CPU in float32, every ``nn.Linear`` (and GPT-2's ``Conv1D``), the LM head
  included, with at least ``MIN_PACKED_ELEMENTS`` weights becomes a ``PackedLinear``: its weight reordered once,
  at load, into oneDNN's blocked layout and applied with ``torch.ops.mkldnn._linear_pointwise`` (the kernel
  ``torch.compile`` uses for linears on CPU).
  Measured on the 2-core bench machine (GPT-2-small shape, one decode step): 36.6 -> 27.8 ms at batch 1,
  93.5 -> 39.9 ms at batch 8, and a 64-token prefill 200 -> 89 ms; MKL's GEMM on the plain layouts is
  particularly slow for 2-8 rows, which is what a continuous batch decodes. oneDNN costs ~20 us more per call
  than MKL, so small matrices (under 512 x 512; the tests' tiny models) stay as they are. The pass checks itself:
  one short forward before and after must agree (float rounding), otherwise the original modules are put back.
  A tied LM head keeps the embedding as it was and adds the packed copy (vocab x hidden floats more memory);
  while the check runs, the original weights and the packed ones are both held.
- ``fuse_gelu_tanh``: transformers' ``NewGELUActivation`` (GPT-2's "gelu_new", eight element-wise ops) becomes
  PyTorch's fused ``GELU(approximate="tanh")``, the same function.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("saker.optimize")

MIN_PACKED_ELEMENTS = 512 * 512  # below this oneDNN's per-call cost outweighs its faster GEMM (2-core CPU)


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with W (out, in) held in oneDNN's reordered layout. It has no ``weight``: nothing can
    read or change the values through it (the shape is ``in_features`` / ``out_features``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        self.bias = None if bias is None else bias.detach()

    @classmethod
    def from_module(cls, module: nn.Module) -> PackedLinear:
        from transformers.pytorch_utils import Conv1D

        if isinstance(module, Conv1D):  # GPT-2's Conv1D stores (in, out)
            return cls(module.weight.t(), module.bias)
        return cls(module.weight, module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _packable(module: nn.Module, min_elements: int) -> bool:
    from transformers.pytorch_utils import Conv1D

    if type(module) not in (nn.Linear, Conv1D):  # exact types: quantized and PEFT layers subclass or wrap
        return False
    weight = module.weight
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.numel() >= min_elements


def _probe(model: nn.Module) -> torch.Tensor:
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.arange(4, device=next(model.parameters()).device).remainder(vocab).view(1, -1)
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits.float()


def pack_linears_onednn(model: nn.Module, min_elements: int | None = None) -> int:
    """Swap every packable linear for a ``PackedLinear``; the number swapped (0 when the pass does not apply)."""
    if (
        not torch.backends.mkldnn.is_available()
        or getattr(model, "hf_device_map", None)
        or getattr(model, "peft_config", None)
    ):
        return 0
    min_elements = MIN_PACKED_ELEMENTS if min_elements is None else min_elements
    found = [(parent, name, child) for parent, name, child in _children(model) if _packable(child, min_elements)]
    return _swap_checked(model, found, PackedLinear.from_module, 1e-4, "oneDNN linear packing")


def _children(model: nn.Module):
    """Every (parent, name, child) of ``model``, listed before any is swapped."""
    return [(parent, name, child) for parent in list(model.modules()) for name, child in list(parent.named_children())]


def _swap_checked(model: nn.Module, found: list, make, tolerance: float, what: str) -> int:
    """Each ``(parent, name, child)`` of ``found`` becomes ``make(child)``, checked: one short forward before and after
    must agree within ``tolerance`` of the logits' size, otherwise the originals are put back and the pass (``what``)
    is logged as not applied. The number swapped."""
    if not found:
        return 0
    swaps = []  # (parent, name, original, new)
    try:
        before = _probe(model)
        swaps = [(parent, name, child, make(child)) for parent, name, child in found]
        for parent, name, _, new in swaps:
            setattr(parent, name, new)
        after = _probe(model)
        scale = tolerance * (1.0 + before.abs().max().item())
        if after.shape != before.shape or not torch.allclose(after, before, rtol=0, atol=scale):
            raise ValueError(f"logits moved by {(after - before).abs().max().item():.3g}")
    except Exception as exc:
        for parent, name, original, _ in swaps:
            setattr(parent, name, original)
        log.warning("%s not applied: %s: %s", what, type(exc).__name__, exc)
        return 0
    return len(swaps)


def fuse_gelu_tanh(model: nn.Module) -> int:
    from transformers.activations import NewGELUActivation

    count = 0
    for parent, name, child in _children(model):
        if type(child) is NewGELUActivation:
            setattr(parent, name, nn.GELU(approximate="tanh"))
            count += 1
    return count


class FixedOrderLinear(nn.Module):
    """An ``nn.Linear`` through ``cuda_kernels.linear`` (the same weight and bias tensors)."""

    def __init__(self, module: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = module.in_features, module.out_features
        self.weight, self.bias = module.weight, module.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from app.engine.model import cuda_kernels

        return cuda_kernels.linear(x, self.weight, self.bias)


class FixedOrderRMSNorm(nn.Module):
    """Llama's RMSNorm (and its copies: Qwen2, Mistral, ...) through ``cuda_kernels.rms_norm``."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.weight, self.variance_epsilon = module.weight, float(module.variance_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from app.engine.model import cuda_kernels

        return cuda_kernels.rms_norm(x, self.weight, self.variance_epsilon)


def _fixed_order_class(module: nn.Module) -> type | None:
    """The fixed-order module that stands in for ``module``, or None."""
    if type(module) is nn.Linear and module.weight.is_floating_point():  # exact type: quantized layers subclass it
        return FixedOrderLinear
    name = type(module).__name__
    if (
        name.endswith("RMSNorm")
        and hasattr(module, "variance_epsilon")
        and not name.startswith(("Gemma", "FixedOrder"))
    ):
        return FixedOrderRMSNorm  # Gemma's scales by 1 + weight
    return None


def make_batch_invariant(model: nn.Module, force: bool = False) -> int:
    """CUDA, ``SAKER_BATCH_INVARIANT``: every float ``nn.Linear`` and Llama-style RMSNorm through the fixed-order
    Triton kernels of ``cuda_kernels``, attention in one launch choice for every width, and inductor's element-wise
    code rounding where eager PyTorch does (``emulate_precision_casts``), so that a position's logits are the same
    bits whether its step computes it alone or among others (a decode row, a row's guessed positions, a wider
    batch). Returns the modules swapped, checked like the other passes (a short forward before and after must agree
    to the dtype's rounding). ``force``: on any device (the tests, through Triton's interpreter)."""
    from app.engine.model import cuda_kernels

    device = next(model.parameters()).device
    if not (force or cuda_kernels.available(device)) or cuda_kernels.triton is None:
        return 0
    found = [(parent, name, child) for parent, name, child in _children(model) if _fixed_order_class(child)]
    tolerance = 1e-3 if next(model.parameters()).dtype == torch.float32 else 5e-2
    swapped = _swap_checked(
        model, found, lambda child: _fixed_order_class(child)(child), tolerance, "batch-invariant kernels"
    )
    if not swapped:
        return 0
    cuda_kernels.set_fixed_order(True)
    import torch._inductor.config as inductor_config

    inductor_config.emulate_precision_casts = True
    return swapped


def optimize_for_inference(model: nn.Module) -> list[str]:
    """Apply every pass that fits; the names of those applied (logged)."""
    applied = []
    if packed := pack_linears_onednn(model):
        applied.append(f"oneDNN-packed linears ({packed})")
    if fuse_gelu_tanh(model):
        applied.append("fused tanh GELU")
    if applied:
        log.info("inference rewrites: %s", ", ".join(applied))
    return applied
