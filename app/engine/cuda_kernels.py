"""saker's CUDA kernel: attention of one query per row over the block pool, in Triton, reading each row's own blocks
in place for as many positions as the row holds.

Why: a compiled decode step on CUDA is a CUDA graph, so its shapes are fixed, and without this kernel every row
read the whole pool capacity through its block table (``attention._read``, 3,072 positions) and attended over it
with a mask. On an H200 that was 6.0 ms of a 12.5 ms 32-row step for the 1B Llama shape. Here the shapes stay fixed
(the table is as wide as the capacity) but each program loops over its row's positions ``[lo, hi)`` only: the cost
follows the rows' real lengths.

The interface is the CPU kernel's (``cpu_kernels.attend``): q (T, Hq, D); keys and values (slots, Hkv, D), the
pool's layer; tables (R, B) block ids; which (T,) each query's table row; lo, hi (T,) the positions it attends over.
One program per (query, kv head) computes that head's group of query heads with an online softmax in float32 and
products in float32 (no TF32); the output is in q's dtype. The kernel is verified on the CPU by Triton's
interpreter (``tests/unit/test_cuda_kernels.py``) and runs compiled only on a GPU.

Triton comes with PyTorch's CUDA builds; where it is missing (the CPU build) ``available`` is False and the engine
keeps ``attention._read`` + SDPA."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # PyTorch's CPU build has no Triton
    triton = None

# Launch choices, measured on an H200 (scripts/gpu/decode_attention_variants.py; 1B Llama layer, bfloat16): below
# PER_HEAD_BELOW queries each query head gets a program of its own (1 row at 160 positions: 8.2 us against 19.8 for
# a kv head's group), with PER_HEAD_LAUNCH's positions per iteration and warps; wider steps give a program a kv
# head's group (32 rows: 25.6 us against 28.8-46.2).
PER_HEAD_BELOW = 8
PER_HEAD_LAUNCH = (64, 8)
GROUP_LAUNCH = (32, 4)
_state: dict[str, object] = {}


def available(device: torch.device) -> bool:
    """Whether the kernel runs on ``device`` (a CUDA device with Triton installed)."""
    return triton is not None and torch.device(device).type == "cuda"


if triton is not None:

    def _decode_attention(  # jitted by ``kernel()``: Triton's interpreter is chosen when the decorator runs
        q_ptr,
        k_ptr,
        v_ptr,
        table_ptr,
        which_ptr,
        lo_ptr,
        hi_ptr,
        out_ptr,
        scale,
        stride_qt,
        stride_qh,
        stride_ks,
        stride_kh,
        stride_vs,
        stride_vh,
        stride_tr,
        stride_ot,
        stride_oh,
        GROUP: tl.constexpr,
        HEADS: tl.constexpr,
        BLOCK_H: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PAGE: tl.constexpr,
    ):
        token = tl.program_id(0)
        first = tl.program_id(1) * HEADS  # this program's query heads: HEADS of them (a kv head's group, or one)
        kv_head = first // GROUP
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        h_ok = h < HEADS
        d_ok = d < D
        heads = first + h
        q = tl.load(
            q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :],
            mask=h_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        row = tl.load(which_ptr + token)
        lo = tl.load(lo_ptr + token)
        hi = tl.load(hi_ptr + token)
        top = tl.full([BLOCK_H], -1.0e30, tl.float32)  # finite: a tile with nothing seen gives weights 0, not NaN
        total = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for start in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
            at = start + tl.arange(0, BLOCK_N)
            seen = (at >= lo) & (at < hi)
            block = tl.load(table_ptr + row * stride_tr + at // PAGE, mask=seen, other=0)
            slot = block * PAGE + at % PAGE
            kv_mask = seen[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
            scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # (BLOCK_H, BLOCK_N)
            scores = (scores * scale).to(tl.float32)  # torch.compile passes a Python float as float64
            scores = tl.where(seen[None, :], scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, axis=1))
            weights = tl.exp(scores - new_top[:, None])
            shrink = tl.exp(top - new_top)
            total = total * shrink + tl.sum(weights, axis=1)
            v = tl.load(v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * shrink[:, None] + tl.sum(weights[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            top = new_top
        out = tl.where(total[:, None] > 0, acc / tl.maximum(total, 1e-30)[:, None], 0.0)
        tl.store(
            out_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=h_ok[:, None] & d_ok[None, :],
        )


def kernel():
    """The jitted kernel (made at the first use)."""
    if "kernel" not in _state:
        _state["kernel"] = triton.jit(_decode_attention)
    return _state["kernel"]


def decode_attention(
    q, keys, values, tables, which, lo, hi, scale: float, jitted=None, per_head=None, block_n=None, warps=None
) -> torch.Tensor:
    """q (T, Hq, D); keys, values (slots, Hkv, D) with unit stride in D; tables (R, B) block ids; which, lo, hi
    (T,). Returns (T, Hq, D) in q's dtype; a query with no position (``lo == hi``) gets zeros. ``jitted``: another
    jitting of the kernel (the tests' interpreted one). Traced by torch.compile as a user-defined Triton kernel, so
    a compiled step keeps it inside its CUDA graph."""
    from app.engine.blocks import BLOCK

    tokens, heads, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    tables = tables.contiguous()
    if per_head is None:
        per_head = tokens < PER_HEAD_BELOW
    launch = PER_HEAD_LAUNCH if per_head else GROUP_LAUNCH
    block_n, warps = block_n or launch[0], warps or launch[1]
    each = 1 if per_head else group
    (jitted or kernel())[(tokens, heads // each)](
        q,
        keys,
        values,
        tables,
        which,
        lo,
        hi,
        out,
        scale,
        q.stride(0),
        q.stride(1),
        keys.stride(0),
        keys.stride(1),
        values.stride(0),
        values.stride(1),
        tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEADS=each,
        BLOCK_H=triton.next_power_of_2(each),
        D=dim,
        BLOCK_D=triton.next_power_of_2(dim),
        BLOCK_N=block_n,
        PAGE=BLOCK,
        num_warps=warps,
    )
    return out
