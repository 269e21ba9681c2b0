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

import os

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


if triton is not None:

    def _linear(  # jitted by ``jit("linear")``
        x_ptr,
        w_ptr,
        b_ptr,
        out_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_om,
        HAS_BIAS: tl.constexpr,
        IEEE: tl.constexpr,
        SUMMED: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        inner = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for start in range(0, K, BLOCK_K):  # every row's sum over K in the same tiles, in the same order
            at = start + inner
            a = tl.load(
                x_ptr + rows[:, None] * stride_xm + at[None, :], mask=(rows[:, None] < M) & (at[None, :] < K), other=0.0
            )
            b = tl.load(
                w_ptr + cols[None, :] * stride_wn + at[:, None], mask=(cols[None, :] < N) & (at[:, None] < K), other=0.0
            )
            if SUMMED:  # Triton's interpreter: its tl.dot is numpy's BLAS, whose bits for a row depend on its place
                acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)  # in the tile
            elif IEEE:  # float32 inputs: float32 products, not TF32 (PyTorch's default for float32 products)
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + rows[:, None] * stride_om + cols[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=(rows[:, None] < M) & (cols[None, :] < N),
        )

    def _rms_norm(x_ptr, w_ptr, out_ptr, stride_x, stride_o, N, eps, BLOCK: tl.constexpr):  # ``jit("rms_norm")``
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        mean = tl.sum(x * x, axis=0) / N
        normed = x * tl.rsqrt((mean + eps).to(tl.float32))  # torch.compile passes a Python float as float64
        normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded to the input's dtype, as Llama's norm
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)

    # jitted at import (torch.compile cannot trace triton.jit itself); the interpreter when TRITON_INTERPRET is set
    _KERNELS = {
        name: triton.jit(fn)
        for name, fn in (("kernel", _decode_attention), ("linear", _linear), ("rms_norm", _rms_norm))
    }


def jit(name: str = "kernel"):
    """A jitted kernel (the tests may put an interpreted one in ``_state``)."""
    return _state.get(name) or _KERNELS[name]


def kernel():
    """The jitted attention kernel."""
    return jit("kernel")


def decode_attention(
    q, keys, values, tables, which, lo, hi, scale: float, jitted=None, per_head=None, block_n=None, warps=None
) -> torch.Tensor:
    """q (T, Hq, D); keys, values (slots, Hkv, D) with unit stride in D; tables (R, B) block ids; which, lo, hi
    (T,). Returns (T, Hq, D) in q's dtype; a query with no position (``lo == hi``) gets zeros. ``jitted``: another
    jitting of the kernel (the tests' interpreted one). Traced by torch.compile as a user-defined Triton kernel, so
    a compiled step keeps it inside its CUDA graph."""
    from app.engine.model.kv_cache import BLOCK

    tokens, heads, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    tables = tables.contiguous()
    if per_head is None:  # in fixed order (``set_fixed_order``) one launch for every width: a query's bits
        per_head = fixed_order() or tokens < PER_HEAD_BELOW
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


# -- fixed-order ("batch-invariant") products and norms --------------------------------------------------------------
# cuBLAS picks its algorithm by the product's shape (split-K for one row, other tiles for more), so the same position
# gets other bits when its step computes 1 query than when it computes 8: for a bfloat16 1B Llama on an H200 the
# logits moved by up to 0.11 and a greedy token changed (scripts/gpu/profile_p.py). These kernels tile every product
# one way whatever the number of rows (no split-K; each row's sum over K in the same BLOCK_K tiles, in order), and
# normalize each row in one program, so a row's result never depends on the others (vLLM's batch-invariant mode
# replaces the same operations for the same reason). Fixed launches: changing one changes the bits.
LINEAR_LAUNCH = (16, 32, 64, 4)  # BLOCK_M, BLOCK_N, BLOCK_K, warps
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read at import, when the kernels are jitted


def set_fixed_order(on: bool) -> None:
    """Attention in one launch choice for every width (``decode_attention``), for ``optimize.make_batch_invariant``."""
    _state["fixed_order"] = on


def fixed_order() -> bool:
    return bool(_state.get("fixed_order"))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in fixed order: x (..., K), weight (N, K); the result in x's dtype."""
    shape = x.shape
    x = x.reshape(-1, shape[-1]).contiguous()
    weight = weight.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k, warps = LINEAR_LAUNCH
    jit("linear")[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x,
        weight,
        weight if bias is None else bias,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,
        SUMMED=INTERPRETED,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
    )
    return out.view(*shape[:-1], n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm (``weight * (x / rms(x)).to(x.dtype)``, the statistics in float32), one program per row."""
    shape = x.shape
    x = x.reshape(-1, shape[-1]).contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    jit("rms_norm")[(x.shape[0],)](
        x, weight, out, x.stride(0), out.stride(0), x.shape[1], eps, BLOCK=triton.next_power_of_2(x.shape[1])
    )
    return out.view(shape)
