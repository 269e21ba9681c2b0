"""The attention function the engine registers with transformers' ``AttentionInterface``: a flat step's attention
over the block pool (``FlatStep``), and for a model that rounds its activations a fixed-order attention.

Why not PyTorch's SDPA for those: its float32 kernels give a query a result that depends on how many queries came
with it (a prompt prefilled at once, in chunks, or its last token alone after the prefix cache: blocked matrix
products and the flash kernel's splits sum in different orders). The differences are a few float32 ulps, and in a
float32 model they stay there (2e-6 in logprobs). But the weight-only int4/int8 kernels (the default on the CPU)
take their inputs in bfloat16: an ulp that moves a value across a bfloat16 rounding boundary becomes a 4e-3 change,
and over 30 layers the embedded model's first-token logprob moved by up to 0.24 between a whole prefill and the
same prompt from the prefix cache, and its greedy answer changed.

So for such a model every query is computed in an order that depends on its own positions only: by the float32
kernel of ``kernels/paged_attention.cpp`` (reading the pool in place; a plain forward's keys laid out as a pool),
or, where it cannot be built, in float64 here (``exact_attention``'s own body: scores, softmax and the weighted sum in
float64, rounded once; queries in tiles of ``TILE``). Every other operation of the model is row-wise (norms, the
MLP, the kernels: bit-identical for 1 to 64 rows), so a position's output does not depend on the path that
computed it: the same logits, to the bit, whether a prompt is prefilled whole, in chunks, from the prefix cache,
alone or beside other rows.

The masks are sdpa's (``sdpa_mask`` is registered under the same name): a boolean 4D mask where one is needed,
None for a plain causal block (the last query sees every key). Models whose attention needs more than a mask
(soft-capping, attention sinks, dropout) keep transformers' SDPA path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from app.engine.model import cpu_kernels, cuda_kernels
from app.engine.model.kv_cache import BLOCK

NAME = "saker"
TILE = 256  # queries per block of scores: a 256 x 8,192 float64 block per head is 16 MB
HEADS_TOGETHER = 2**17  # keys (elements) up to which every head goes in one product (1 MiB in float64)


def exact_attention(module, query, key, value, attention_mask, scaling=None, is_causal=None, **_) -> tuple:
    """query (B, Hq, Lq, D), key and value (B, Hkv, Lk, D) -> (B, Lq, Hq, D) in query's dtype, in a fixed order:
    by the float32 kernel (``cpu_kernels.call``) where it is built for this head dim and every query's keys are one
    run, else in float64 (below). ``attention_mask``: SDPA's (boolean, or added to the scores); None: causal, the
    last query sees every key (or no mask at all with ``is_causal`` False).

    Each kv head's group of query heads are the rows of one product (grouped-query attention without copying keys).
    Keys and values may have any row stride: those the block pool gives are rows of (B, Lk, Hkv, D). Large ones go
    one kv head at a time, so that each head's (B, Lk, D) matrices are read where they are (no copy when the pool is
    float64, as it is for the models that take this path); small ones all heads in one product (fewer operations
    per layer, the products' copy of strided keys being small)."""
    batch, heads, length, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    group = heads // kv_heads
    scale = scaling if scaling is not None else dim**-0.5
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if query.dtype == torch.float32 and cpu_kernels.supports(dim):
        spans = _spans(attention_mask, batch, length, keys, is_causal)
        if spans is not None:
            return _kernel_attention(query, key, value, spans, scale), None
    q = query.double().view(batch, kv_heads, group, length, dim)
    mask = None
    if attention_mask is not None:  # (B|1, 1|Hq, Lq, Lk) -> (B|1, 1|Hkv, 1|group, Lq, Lk)
        mask = attention_mask
        if mask.shape[1] == 1:
            mask = mask.unsqueeze(2)
        else:
            mask = mask.reshape(mask.shape[0], kv_heads, group, mask.shape[-2], mask.shape[-1])
    causal = attention_mask is None and is_causal and length > 1
    out = torch.empty(batch, kv_heads, group, length, value.shape[-1], dtype=torch.float64, device=query.device)
    together = key.numel() <= HEADS_TOGETHER
    for span in [slice(0, kv_heads)] if together else [slice(h, h + 1) for h in range(kv_heads)]:
        count = span.stop - span.start
        k, v = key[:, span].double(), value[:, span].double()  # (B, h, Lk, D): no copy when already float64
        span_mask = None if mask is None else (mask[:, span] if mask.shape[1] > 1 else mask)
        for start in range(0, length, TILE):
            end = min(start + TILE, length)
            rows = end - start
            # causal without a mask: keys past the tile's last query are never seen (float64 sums do not depend
            # on the trailing zeros they would add, to float32 rounding)
            seen = keys - length + end if causal else keys
            tile = q[:, span, :, start:end].reshape(batch, count, group * rows, dim)
            scores = torch.matmul(tile, k[:, :, :seen].transpose(-1, -2)).mul_(scale)
            scores = scores.view(batch, count, group, rows, seen)
            if span_mask is not None:
                block = span_mask[..., start:end, :]
                if block.dtype == torch.bool:
                    scores = scores.masked_fill(~block, float("-inf"))
                else:
                    scores = scores + block.double()
            elif causal:  # query i sits at key position Lk - Lq + i
                at = torch.arange(start, end, device=query.device).view(-1, 1) + (keys - length)
                scores = scores.masked_fill(torch.arange(seen, device=query.device).view(1, -1) > at, float("-inf"))
            probs = torch.softmax(scores, dim=-1).view(batch, count, group * rows, seen)
            out[:, span, :, start:end] = torch.matmul(probs, v[:, :, :seen]).view(batch, count, group, rows, -1)
    # a row with every key masked (padding) gives NaN from softmax: zeros instead
    out = out.nan_to_num_(0.0).view(batch, heads, length, -1)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _spans(mask, batch: int, length: int, keys: int, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The keys each query of a plain forward sees, as ``[lo, hi)`` per query (batch x length,), from SDPA's mask
    (boolean, or added to the scores) or causality; None when some query's keys are not one run (the float64 path
    then computes it). A query that sees no key gets ``lo == hi``."""
    device = None if mask is None else mask.device
    if mask is None:
        at = torch.arange(keys - length + 1, keys + 1) if is_causal and length > 1 else torch.full((length,), keys)
        hi = at.repeat(batch)
        return torch.zeros_like(hi), hi
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == float("-inf")) | (mask == torch.finfo(mask.dtype).min)).all()):
            return None
        mask = mask == 0
    if mask.shape[1] != 1:  # one mask per head: only when every head's is the same
        if not bool((mask == mask[:, :1]).all()):
            return None
    rows = mask[:, 0].expand(batch, length, keys).reshape(batch * length, keys)
    seen = rows.any(-1)
    lo = torch.where(seen, rows.int().argmax(-1), 0).long()
    hi = torch.where(seen, keys - rows.flip(-1).int().argmax(-1), 0).long()
    if not bool((rows.sum(-1) == hi - lo).all()):
        return None
    return lo.to(device), hi.to(device)


def _kernel_attention(query, key, value, spans, scale: float) -> torch.Tensor:
    """A plain forward's attention by ``paged_attention`` (the kernel the flat steps use, so a plain forward gives
    every position what the engine gives it): keys and values laid out as a pool of one table per batch row.
    Returns (B, Lq, Hq, D)."""
    batch, heads, length, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    blocks = -(-keys // BLOCK)

    def pooled(x):
        out = x.new_zeros(batch, blocks * BLOCK, kv_heads, dim, dtype=torch.float32)
        out[:, :keys] = x.transpose(1, 2)
        return out.view(batch * blocks * BLOCK, kv_heads, dim)

    tables = torch.arange(batch * blocks).view(batch, blocks)
    which = torch.arange(batch).repeat_interleave(length)
    q = query.transpose(1, 2).reshape(batch * length, heads, dim)
    lo, hi = spans
    out = cpu_kernels.call(q, pooled(key), pooled(value), tables, which, lo, hi, scale)
    return out.view(batch, length, heads, dim)


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    flat: "FlatStep | None" = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function registered as ``NAME``: a flat step's attention over the block pool when the forward carries
    one (``flat``), otherwise the model's own attention: float64 (``exact_attention``) for a model that rounds
    its activations, SDPA for the others. Models whose attention needs more than a mask (soft-capping, attention
    sinks, dropout) keep SDPA's path."""
    if flat is not None:
        return flat_attention(module, query, key, value, flat, scaling, kwargs.get("sliding_window"))
    if (
        getattr(module, "_saker_exact", False)
        and not dropout
        and kwargs.get("softcap") is None
        and kwargs.get("s_aux") is None
    ):
        return exact_attention(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


@dataclass
class FlatStep:
    """One step's tokens over the block pool (``kv_cache.KVPool``): first ``rows`` decode tokens, one per running
    sequence, then the chunks of prompts being prefilled. Every token's key and value are written at its pool slot
    (``write``); decode row ``i`` attends over the blocks ``gather[i]`` (its blocks in order, padded with the null
    block) where ``row_mask[i]`` is set; a chunk ``(blocks, start, count)`` is its sequence's positions
    ``start .. start + count - 1``, attending causally over the sequence's first ``start + count`` positions, which
    live in ``blocks``. Blocks are read whole (``index_select`` of ``BLOCK`` positions at a time).

    ``batched``: a decode-only step feeds its rows as the forward's batch (one token each: query (rows, H, 1, D),
    what peft's per-row adapters and a compiled step want); otherwise the step is one flat sequence (batch 1).

    A layer with a sliding window (transformers passes its ``sliding_window``) sees only the last ``window``
    positions up to each query's own (``kv > q - window``, transformers' rule): a decode row's mask also hides the
    positions before ``row_positions - window + 1``, a chunk's mask is causal within the window."""

    keys: list  # the pool's, per layer (slots, kv heads, head dim)
    values: list
    write: torch.Tensor  # (T,) long
    rows: int
    gather: torch.Tensor | None = None  # (rows, blocks) long
    row_mask: torch.Tensor | None = None  # (rows, 1, 1, blocks x BLOCK) bool
    row_positions: torch.Tensor | None = None  # (rows,) long: each decode row's position
    chunks: tuple[tuple[torch.Tensor, int, int], ...] = ()
    batched: bool = False
    scratch: "Scratch | None" = None  # where blocks are read into (None: fresh tensors; a compiled step)
    kernel: bool = False  # every query through the one attention kernel (the compiled flat step: ``_spans`` given)
    _spans: dict = field(default_factory=dict, repr=False)  # window -> ``spans``, made at the first layer

    def spans(self, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's tokens for ``paged_attention``: ``(tables, which, lo, hi)``, the block tables (the decode rows'
        ``gather``, then one per chunk), each token's table row and the positions it attends over, ``[lo, hi)``
        (its own and those before it, the last ``window`` of them with a sliding window). Made once per step and
        window (every layer's are the same)."""
        if window not in self._spans:
            tables, which, his = [], [], []
            device = self.write.device
            if self.rows:
                tables.append(self.gather)
                which.append(torch.arange(self.rows, device=device))
                his.append(self.row_positions + 1)
            for j, (blocks, start, count) in enumerate(self.chunks):
                tables.append(blocks.view(1, -1))
                which.append(torch.full((count,), self.rows + j, dtype=torch.long, device=device))
                his.append(torch.arange(start + 1, start + count + 1, device=device))
            width = max(t.shape[1] for t in tables)
            tables = [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tables]
            hi = torch.cat(his)
            lo = (hi - window).clamp_min(0) if window else torch.zeros_like(hi)
            self._spans[window] = (torch.cat(tables), torch.cat(which), lo, hi)
        return self._spans[window]


class Scratch:
    """Reusable buffers for the blocks a step reads: every layer of a step reads the same amount, and a fresh
    tensor of tens of MB per read costs more in page faults than the copy itself (glibc hands large allocations
    back to the kernel: 5 ms instead of 1.5 ms to read 25 MB on the CPU)."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        size = 1
        for n in shape:
            size *= n
        key = (name, like.dtype, like.device)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < size:
            buffer = self.buffers[key] = torch.empty(
                max(size, 2 * (0 if buffer is None else buffer.numel())), dtype=like.dtype, device=like.device
            )
        return buffer[:size].view(shape)


def _read(pool: torch.Tensor, blocks: torch.Tensor, scratch: Scratch | None = None, name: str = "") -> torch.Tensor:
    """The positions of ``blocks`` (any shape S) of one layer's pool: (S..., blocks x BLOCK positions, H, D) ->
    transposed to (S..., H, positions, D); read into ``scratch``'s buffer ``name`` when given."""
    heads, dim = pool.shape[1], pool.shape[2]
    index = blocks.reshape(-1)
    source = pool.view(-1, BLOCK, heads, dim)
    if scratch is None:
        out = source.index_select(0, index)
    else:
        out = torch.index_select(source, 0, index, out=scratch.get(name, (index.numel(), BLOCK, heads, dim), pool))
    return out.view(*blocks.shape[:-1], blocks.shape[-1] * BLOCK, heads, dim).transpose(-3, -2)


def flat_attention(module, query, key, value, flat: FlatStep, scaling, window: int | None = None):
    """query (1, Hq, T, D), key and value (1, Hkv, T, D) of a flat step (batched: (rows, H, 1, D)) -> (1, T, Hq, D)
    (batched: (rows, 1, Hq, D)). ``window``: this layer's sliding window (None: it sees every earlier position)."""
    keys, values = flat.keys[module.layer_idx], flat.values[module.layer_idx]
    if flat.batched:
        new_keys, new_values = key[:, :, 0], value[:, :, 0]
    else:
        new_keys, new_values = key[0].transpose(0, 1), value[0].transpose(0, 1)
    keys.index_copy_(0, flat.write, new_keys.to(keys.dtype))
    values.index_copy_(0, flat.write, new_values.to(values.dtype))
    exact = getattr(module, "_saker_exact", False)
    on_cuda = cuda_kernels.available(keys.device)
    # every query through one kernel: the CPU's fixed-order float32 one (the pool is float64 where it is not built),
    # on CUDA in fixed order (SAKER_BATCH_INVARIANT), or in the compiled flat step (``flat.kernel``: on CUDA one
    # CUDA graph per token bucket, prompt chunks included); prompt chunks' queries are rows of their own there
    if flat.kernel or (exact and keys.dtype == torch.float32) or (on_cuda and cuda_kernels.fixed_order()):
        q = query[:, :, 0] if flat.batched else query[0].transpose(0, 1)  # (T, Hq, D)
        tables, which, lo, hi = flat.spans(window)
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        attend = cuda_kernels.decode_attention if on_cuda else cpu_kernels.call
        out = attend(q, keys, values, tables, which, lo, hi, scale)
        return (out.unsqueeze(1) if flat.batched else out.unsqueeze(0)), None
    inner = exact_attention if exact else _sdpa
    parts = []
    rows = flat.rows
    # decode rows read the pool in place (the CPU's float32 kernel where it is built: 0.86-0.89x the time of the
    # tiny model's 32-row step against gathering the blocks for SDPA)
    in_place = on_cuda or (keys.dtype == torch.float32 and getattr(module, "_saker_kernel_attends", False))
    if rows and in_place:  # each row over its own positions, read in place
        q = query[:, :, 0] if flat.batched else query[0, :, :rows].transpose(0, 1)  # (rows, Hq, D)
        tables, which, lo, hi = flat.spans(window)
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        attend = cuda_kernels.decode_attention if on_cuda else cpu_kernels.call
        out = attend(q, keys, values, tables, which[:rows], lo[:rows], hi[:rows], scale)
        if flat.batched:
            return out.unsqueeze(1), None
        parts.append(out.unsqueeze(0))
    elif rows:
        q = query if flat.batched else query[0, :, :rows].transpose(0, 1).unsqueeze(2)  # (rows, Hq, 1, D)
        k = _read(keys, flat.gather, flat.scratch, "rows keys")  # (rows, Hkv, W, D)
        v = _read(values, flat.gather, flat.scratch, "rows values")
        mask = flat.row_mask
        if window:
            width = mask.shape[-1]
            seen = torch.arange(width, device=mask.device).view(1, -1) > flat.row_positions.view(-1, 1) - window
            mask = mask & seen.view(rows, 1, 1, width)
        out = inner(module, q, k, v, mask, scaling=scaling)[0]  # (rows, 1, Hq, D)
        if flat.batched:
            return out, None
        parts.append(out.view(1, rows, query.shape[1], -1))
    offset = rows
    for blocks, start, count in flat.chunks:  # a few per step: the prompts being prefilled
        q = query[:, :, offset : offset + count]
        end = start + count
        k = _read(keys, blocks.view(1, -1), flat.scratch, "chunk keys")[:, :, :end]  # (1, Hkv, end, D)
        v = _read(values, blocks.view(1, -1), flat.scratch, "chunk values")[:, :, :end]
        mask = None  # causal, the chunk's queries at its last positions
        if window:
            at = torch.arange(start, end, device=q.device).view(-1, 1)
            kv = torch.arange(end, device=q.device).view(1, -1)
            mask = ((kv <= at) & (kv > at - window)).view(1, 1, count, end)
        parts.append(inner(module, q, k, v, mask, scaling=scaling)[0])
        offset += count
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)), None


def _sdpa(module, query, key, value, mask, scaling=None):
    """SDPA with a mask always given (its own ``is_causal`` aligns a block of queries to the first keys, not the
    last): None means causal with the queries at the last key positions."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if mask is None:
        length, keys = query.shape[2], key.shape[2]
        mask = torch.arange(keys, device=query.device).view(1, -1) <= torch.arange(
            keys - length, keys, device=query.device
        ).view(-1, 1)
        mask = mask.view(1, 1, length, keys)
    return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, is_causal=False)


def use_engine_attention(model: torch.nn.Module) -> bool:
    """Register ``attention`` for ``model`` (whose attention goes through transformers' ``AttentionInterface`` with
    SDPA or eager): it runs the engine's flat steps, and for a model whose linears round their inputs (int16 or
    bfloat16: the weight-only int4/int8 kernels, the default for the embedded model) on the CPU its attention is float64
    (``exact_attention``). A float32 model's prompt chunks keep SDPA (its paths differ by float32 ulps only, 2e-6 in
    logprobs, and SDPA's flash kernel prefills about twice as fast); its decode rows read the pool in place through
    the same kernel (``flat_attention``). Returns whether it was registered."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from app.engine.model.quantize import rounds_activations

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    configs = [m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "_attn_implementation")]
    if not configs or any(c._attn_implementation not in ("sdpa", "eager", NAME) for c in configs):
        return False
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    exact = device.type == "cpu" and rounds_activations(model)
    for config in configs:
        config._attn_implementation = NAME
    for module in model.modules():  # read by ``attention`` from the module it is called for
        module._saker_exact = exact
    # on the CPU the kernels are built now, at load, not by the first request that asks for logprobs (their
    # log-softmax is the kernels': ``logprobs.log_softmax``)
    if device.type == "cpu":
        cpu_kernels.kernel()
    return True
