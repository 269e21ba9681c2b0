"""Weight-only int8 / int4 linears (SAKER_QUANTIZE=int8 | int4) on saker's CPU kernels and PyTorch's own, CPU and
CUDA.

- ``Int8Linear``: one int8 per weight, one scale per output channel (symmetric: ``w = q * scale``), applied with
  ``aten._weight_int8pack_mm`` (CPU, and CUDA where this PyTorch has its kernel); the LM head on the CPU by
  saker's float32 kernel (``mark_head``).
- ``Int4Linear``: one 4-bit code per weight in groups of 32 along the input, with a scale and a zero per group
  (``w = (q - 8) * scale + zero``, q in 0..15: the layout GGUF's Q4_0/Q4_1 blocks map onto exactly), packed once
  at load for the kernel that serves it (``int4_layout``): on the CPU saker's (``cpu_kernels.int4_linear``: two
  codes a byte, float32 scales and mins; the float32 inputs quantized to int16 per group, exact integer products),
  or where saker's kernels cannot be built PyTorch's (``aten._weight_int4pack_mm_for_cpu``); on CUDA (compute
  capability 8.0 and up) two codes per byte, ``aten._convert_weight_to_int4pack`` and ``aten._weight_int4pack_mm``
  (tinygemm). All read the same codes, scales and zeros.

Activations stay in the model's dtype between the linears (PyTorch's kernels compute in bfloat16: ``KERNEL_DTYPE``);
only the weights are quantized, every ``nn.Linear`` and GPT-2 ``Conv1D``
the LM head included (a tied head gets its own quantized copy; the embedding stays as it was; with int4 the head
is int8). Shapes the int4 kernel cannot take (inputs not in whole groups of 32, outputs not a multiple of 16) stay
in float. A quantized
model's logprobs are its own: the exact path is ``SAKER_QUANTIZE`` unset. The tests compare the kernels against
the same codes de-quantized in float32 by plain tensor arithmetic (``int4_codes``, ``Int8Linear.dequantized``).

Measured on the 2-core machine (SmolLM2-135M, one token, batch 1): see docs/performance.md.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from app.engine.model import cpu_kernels

log = logging.getLogger("saker.quantize")

GROUP = 32  # int4: weights per (scale, zero) group along the input dimension
INNER_K_TILES = 2  # the CPU packing's; CUDA takes the largest of 8, 4, 2 that the input size allows
# The dtype the kernels compute in: PyTorch's CPU weight-only kernels have fast (vectorised) paths for bfloat16
# activations and scales only; with float32 (or float16) they fall back to a scalar loop 10-50x slower than a
# float32 matmul (measured on the 2-core machine: int8 1536x576 at batch 1, 5.4 ms in float32, 0.04 ms in
# bfloat16). Inputs are rounded to bfloat16 on the way in and outputs cast back to the model's dtype, as
# llama.cpp rounds activations to 8 bits for its 4-bit dot products.
KERNEL_DTYPE = torch.bfloat16


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, device: torch.device | str = "cpu"):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        qweight = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8).contiguous()
        self.register_buffer("qweight", qweight.to(device))
        self.register_buffer("scales", scale.to(KERNEL_DTYPE).to(device))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(device), requires_grad=False)

    float_logits = False  # the model's LM head on the CPU (``mark_head``): float32 outputs by saker's own kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.float_logits and x.dtype == torch.float32 and self.qweight.device.type == "cpu":
            out = cpu_kernels.int8_linear(x.reshape(-1, shape[-1]), self.qweight, self.float_scales)
        else:
            out = torch.ops.aten._weight_int8pack_mm(
                x.reshape(-1, shape[-1]).to(KERNEL_DTYPE), self.qweight, self.scales
            )
        out = out.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return out + self.bias if self.bias is not None else out

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


def int4_codes(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes of a (N, K) weight per group of ``group`` inputs: (codes int32 0..15 (N, K),
    scales (N, K/group), zeros (N, K/group)) with ``w ~ (q - 8) * scale + zero``."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // group, group)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((high - low) / 15.0).clamp(min=1e-12)
    codes = torch.clamp(torch.round((w - low[..., None]) / scale[..., None]), 0, 15).to(torch.int32)
    return codes.view(n, k), scale, low + 8.0 * scale


def cuda_inner_k_tiles(in_features: int) -> int:
    """The CUDA packing's inner K tiles: the largest of 8, 4, 2 whose tile (16 inputs each) divides the input."""
    return next(t for t in (8, 4, 2) if in_features % (16 * t) == 0)


def pack_int4(codes: torch.Tensor, device: torch.device) -> torch.Tensor:
    """(N, K) int codes 0..15 in the packed layout of ``device``'s PyTorch int4 kernel."""
    if device.type == "cuda":
        # two codes per byte, the even input in the high nibble
        codes = codes.to(torch.int32)
        pairs = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8).contiguous().to(device)
        return torch.ops.aten._convert_weight_to_int4pack(pairs, cuda_inner_k_tiles(codes.shape[1]))
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), INNER_K_TILES)


def pack_int4_cpu(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int = GROUP
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) int codes 0..15 and their (N, K / 32) scales and mins in saker's CPU layout
    (``kernels/int4_linear.cpp``), outputs in tiles of 8: codes (N, K / 2) uint8 holding (N / 8, K / 32, 8, 16)
    bytes, byte ``2 * o + e`` of a tile's group's chunk ``c`` holding output ``o``'s code of input ``2c + e`` in its
    low nibble and of input ``2c + 16 + e`` in its high one; scales and mins float32 (N, K / 32) holding
    (N / 8, K / 32, 8)."""
    n, k = codes.shape
    assert group == 32 and n % 8 == 0, "groups of 32 inputs, outputs in tiles of 8"
    tiles = codes.to(torch.uint8).reshape(n // 8, 8, k // group, group // 2, 2)  # tile, output, group, pair, e
    tiles = tiles.permute(0, 2, 3, 1, 4)  # tile, group, pair, output, e
    packed = (tiles[:, :, :8] | (tiles[:, :, 8:] << 4)).reshape(n, k // 2).contiguous()

    def per_tile(values: torch.Tensor) -> torch.Tensor:
        return values.float().reshape(n // 8, 8, k // group).transpose(1, 2).reshape(n, k // group).contiguous()

    return packed, per_tile(scales), per_tile(mins)


def int4_layout(device: torch.device | str) -> str:
    """Which int4 kernel serves on ``device``: ``"saker"`` (``cpu_kernels.int4_linear``: float32 inputs, int16 dot
    products) on a CPU where saker's kernels are built, else ``"torch"`` (PyTorch's, bfloat16 inputs)."""
    if torch.device(device).type == "cpu" and cpu_kernels.kernel() is not None:
        return "saker"
    return "torch"


class Int4Linear(nn.Module):
    """An int4 linear, ``w = (q - 8) * scale + zero`` per group of 32 inputs, in one of two layouts
    (``int4_layout``): saker's CPU kernel (buffers ``packed`` (N, K / 2) uint8, ``scales`` and ``mins`` (N, K / 32)
    float32, ``min = zero - 8 * scale``, all three in ``pack_int4_cpu``'s tiles of 8 outputs) or PyTorch's for the
    device (``packed`` as ``pack_int4`` gives it, ``scale_zeros`` (K / 32, N, 2) bfloat16)."""

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        bias: torch.Tensor | None,
        group: int = GROUP,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.group = group
        self.layout = int4_layout(device)
        if self.layout == "saker":
            mins = (zeros.double() - 8.0 * scales.double()).float()  # one rounding, not two
            packed, scales, mins = pack_int4_cpu(codes, scales, mins, group)
            self.register_buffer("packed", packed.to(device))
            self.register_buffer("scales", scales.to(device))
            self.register_buffer("mins", mins.to(device))
        else:
            self.register_buffer("packed", pack_int4(codes, torch.device(device)))
            # (K / group, N, 2): each group's scale and zero, the layout both of PyTorch's kernels read
            scale_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(KERNEL_DTYPE)
            self.register_buffer("scale_zeros", scale_zeros.to(device))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(device), requires_grad=False)

    @classmethod
    def from_weight(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, device: torch.device | str = "cpu"
    ) -> "Int4Linear":
        codes, scales, zeros = int4_codes(weight)
        return cls(codes, scales, zeros, bias, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if self.layout == "saker":
            out = cpu_kernels.int4_linear(flat.float(), self.packed, self.scales, self.mins)
        elif self.packed.device.type == "cuda":
            out = torch.ops.aten._weight_int4pack_mm(flat.to(KERNEL_DTYPE), self.packed, self.group, self.scale_zeros)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat.to(KERNEL_DTYPE), self.packed, self.group, self.scale_zeros
            )
        out = out.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        kernel = "int16 x int4 dot products" if self.layout == "saker" else "bfloat16 inputs"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {self.group}, {kernel}"
        )


def mark_head(model: nn.Module) -> None:
    """An int8 LM head on the CPU computes its logits in float32 (``cpu_kernels.int8_linear``) where saker's CPU
    kernels are built: PyTorch's int8 kernel returns bfloat16, whose grid (steps of 0.25-0.5 at a small model's
    logit sizes) made logprobs move in such steps and tokens tie exactly."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, Int8Linear) and head.qweight.device.type == "cpu" and cpu_kernels.kernel() is not None:
        head.float_scales = head.scales.float()  # converted once, not at every step (a plain attribute: not saved)
        head.float_logits = True


def rounds_activations(model: nn.Module) -> bool:
    """Whether some linear of ``model`` rounds its float inputs before its product (int16 per group in saker's int4
    kernel, bfloat16 (``KERNEL_DTYPE``) in PyTorch's int4 and int8 kernels): a few float32 ulps before such a linear
    can then move its output by a rounding step (see ``app/engine/model/attention.py``)."""
    return any(isinstance(m, (Int4Linear, Int8Linear)) for m in model.modules()) and KERNEL_DTYPE != torch.float32


def kernel_problem(mode: str, device: str) -> str | None:
    """Why this PyTorch cannot run ``mode``'s kernel on ``device``, in words; None when a one-group product
    runs (CUDA's int4 kernel wants compute capability 8.0 and up; its int8 kernel is in recent PyTorch only)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return None
    if dev.type != "cuda" or not torch.cuda.is_available():
        return f"{device} is not a visible CUDA device"
    try:
        x = torch.ones(1, 64)
        if mode == "int8":
            Int8Linear(torch.ones(16, 64), None, device=dev)(x.to(dev))
        else:
            Int4Linear.from_weight(torch.ones(16, 64), None, device=dev)(x.to(dev))
        torch.cuda.synchronize(dev)
    except (RuntimeError, NotImplementedError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return f"this PyTorch ({torch.__version__}) has no CUDA {mode} weight-only kernel for this GPU ({first})"
    return None


def _weight_of(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, Conv1D):  # GPT-2's Conv1D stores (in, out)
        return module.weight.t(), module.bias
    return module.weight, module.bias


def quantizable(module: nn.Module, mode: str) -> bool:
    from transformers.pytorch_utils import Conv1D

    if type(module) not in (nn.Linear, Conv1D) or module.weight.device.type != "cpu":
        return False  # quantized from the float weights on the CPU, then packed for the device they serve on
    weight, _ = _weight_of(module)
    out_features, in_features = weight.shape
    # the int4 kernels pack outputs by 16 (CUDA; the CPU's by 8) and read inputs in whole groups; other shapes stay
    # as they are
    return mode == "int8" or (in_features % GROUP == 0 and out_features % 16 == 0)


def quantize_model(model: nn.Module, mode: str, gguf: str | None = None, device: torch.device | str = "cpu") -> str:
    """Swap every quantizable linear (its float weights on the CPU) for its int8/int4 module packed for
    ``device``; returns the precision served, in words. The rest of the model stays where it is.

    ``gguf``: the GGUF file the weights were de-quantized from. With int4, a linear whose rows are that file's
    Q4_0/Q4_1/Q4_K rows takes their codes, scales and zeros as shipped (``gguf_codes``) instead of being
    re-quantized from the de-quantized floats (which would round a second time)."""
    swaps = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if quantizable(child, mode):
                swaps.append((parent, name, child))
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    index = None
    if gguf and mode == "int4":
        from app.engine.model.gguf_codes import read_int4_tensors

        _, index = read_int4_tensors(gguf)
    shipped = 0
    for parent, name, child in swaps:
        weight, bias = _weight_of(child)
        # int4 keeps the LM head at int8, as llama.cpp's 4-bit mixes keep their output tensor at 6-8 bits: the
        # head decides every token and its weights (a tied embedding) often are not on a 4-bit grid
        if mode == "int8" or child is head:
            module = Int8Linear(weight, bias, device=device)
        else:
            rows = index.lookup(weight) if index is not None else None
            if rows is not None:
                module = Int4Linear(rows.codes, rows.scales, rows.zeros, bias, device=device)
                shipped += 1
            else:
                module = Int4Linear.from_weight(weight, bias, device=device)
        setattr(parent, name, module)
    mark_head(model)
    return describe(mode, len(swaps), shipped, head is not None and any(c is head for _, _, c in swaps))


def describe(mode: str, linears: int, shipped: int, head: bool) -> str:
    """The served precision in words (the start-up log and /v1/models)."""
    if mode == "int8":
        return f"int8 weights per output channel ({linears} linears{', the LM head included' if head else ''})"
    words = f"int4 weights in groups of 32 ({linears - head} linears"
    if shipped:
        words += f", {shipped} of them the GGUF file's 4-bit codes as shipped"
    return words + ("), the LM head int8" if head else ")")


# -- the on-disk cache of a quantized model's modules ---------------------------------------------------------
def quantized_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """The quantized modules' tensors (``name.buffer``) and what rebuilds each module (``name -> facts``)."""
    tensors, modules = {}, {}
    for name, module in model.named_modules():
        if isinstance(module, (Int8Linear, Int4Linear)):
            kind = "int8" if isinstance(module, Int8Linear) else "int4"
            facts = {"kind": kind, "in": module.in_features, "out": module.out_features}
            if kind == "int4":
                facts["group"] = module.group
                facts["layout"] = module.layout
            modules[name] = facts
            for key, tensor in module.state_dict().items():
                tensors[f"{name}.{key}"] = tensor.contiguous()
    return tensors, modules


def restore_quantized(
    model: nn.Module, tensors: dict[str, torch.Tensor], modules: dict[str, dict], device: torch.device | str = "cpu"
) -> None:
    """Put cached quantized modules in place of the model's linears (names as ``quantized_state`` gave them), on
    ``device`` (the cache's packed layout is that device's: its key says which)."""
    for name, facts in modules.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        cls = Int8Linear if facts["kind"] == "int8" else Int4Linear
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.out_features, module.in_features = facts["out"], facts["in"]
        if facts["kind"] == "int4":
            module.group = facts["group"]
            module.layout = facts.get("layout", "torch")
        for key in ("qweight", "scales", "packed", "scale_zeros", "mins"):
            if f"{name}.{key}" in tensors:
                # a copy: safetensors hands out views of the file at any offset, and the kernels' vector loads
                # crash (SIGSEGV, seen on _weight_int8pack_mm) on storage that is not aligned as torch allocates it
                module.register_buffer(key, tensors[f"{name}.{key}"].to(device, copy=True))
        bias = tensors.get(f"{name}.bias")
        module.bias = None if bias is None else nn.Parameter(bias.to(device), requires_grad=False)
        setattr(parent, attr, module)
    mark_head(model)
