"""The Triton decode-attention kernel's launch variants on the GPU, against the path it replaced (the rows' blocks
read over the whole capacity, then SDPA with a mask): GPU time per call (CUDA graphs, ``triton.testing``) for the 1B
Llama shape's layer (32 query heads, 8 kv heads, head dim 64, bfloat16) at 1 and 32 rows and two lengths.

    python3 scripts/gpu/decode_attention_variants.py"""

import torch
import triton.testing

from app.engine.model import cuda_kernels
from app.engine.model.attention import _read, _sdpa
from app.engine.core.blocks import BLOCK

HQ, HKV, D, CAPACITY = 32, 8, 64, 3072
torch.manual_seed(0)
slots = (CAPACITY // BLOCK * 33 + 1) * BLOCK
keys = torch.randn(slots, HKV, D, device="cuda", dtype=torch.bfloat16)
values = torch.randn_like(keys)


class Module:
    is_causal = True
    num_key_value_groups = HQ // HKV
    training = False


for rows in (1, 32):
    for length in (160, 640):
        tables = (torch.randperm(slots // BLOCK - 1, device="cuda")[: rows * CAPACITY // BLOCK] + 1).view(rows, -1)
        which = torch.arange(rows, device="cuda")
        hi = torch.full((rows,), length, device="cuda")
        lo = torch.zeros_like(hi)
        q = torch.randn(rows, HQ, D, device="cuda", dtype=torch.bfloat16)
        mask = (torch.arange(CAPACITY, device="cuda").view(1, -1) < hi.view(-1, 1)).view(rows, 1, 1, CAPACITY)

        def old(q=q, tables=tables, mask=mask):
            k, v = _read(keys, tables), _read(values, tables)
            return _sdpa(Module(), q.unsqueeze(2), k, v, mask, scaling=0.125)

        line = [f"rows {rows:2d} length {length:4d}: old {triton.testing.do_bench_cudagraph(old) * 1000:7.1f} us"]
        for per_head in (False, True):
            for block_n in (32, 64, 128):
                for warps in (2, 4, 8):

                    def new(args=(q, keys, values, tables, which, lo, hi), launch=(per_head, block_n, warps)):
                        per_head, block_n, warps = launch
                        return cuda_kernels.decode_attention(
                            *args, 0.125, per_head=per_head, block_n=block_n, warps=warps
                        )

                    try:
                        us = triton.testing.do_bench_cudagraph(new) * 1000
                    except Exception as exc:  # a variant that does not compile (registers)
                        us = float("nan")
                        print(type(exc).__name__, str(exc)[:200])
                    line.append(f"{'head' if per_head else 'group'}/{block_n}/{warps} {us:6.1f}")
        print(" | ".join(line), flush=True)
