"""KV storage: the block pool the running batch keeps every sequence's keys and values in (``KVPool``), and the
KV budget's arithmetic (bytes per position, the default budget)."""

from __future__ import annotations

import torch

BLOCK = 16  # positions per block (a prefix-cache hit is at least one block)


def kv_bytes_per_token(cache, dtype: torch.dtype | None = None) -> int:
    """Bytes one token position takes in a prefilled cache (all layers, keys and values), stored in ``dtype`` (None:
    the cache's own)."""
    total = 0
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            total += tensor[0, :, 0].numel() * (dtype.itemsize if dtype is not None else tensor.element_size())
    return total


def default_kv_budget(bytes_per_token: int, device: torch.device) -> int:
    """Token positions for the decode batch's KV cache when no budget is set: 90% of the GPU memory free after
    loading on CUDA, a quarter of the machine's memory on the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        room = int(free * 0.9)
    else:
        import os

        room = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    return max(1, room // max(1, bytes_per_token))


# -- the block pool ------------------------------------------------------------------------------------------------
class KVPool:
    """Keys and values of every block of the KV cache, per layer: ``(blocks x BLOCK, kv heads, head dim)`` each, on
    that layer's device, in its dtype (``like``: a probe cache of one position). Position ``p`` of a sequence lives
    at slot ``table[p // BLOCK] * BLOCK + p % BLOCK`` (``blocks.BlockManager`` keeps the tables).

    The storage is allocated once, for the whole budget, with ``torch.empty``: on the CPU its pages are only taken
    when first written, and blocks are handed out lowest first, so the memory used follows the blocks in use. A block
    is zeroed when first handed out (``touch``), so that padding positions a step reads are finite; block 0, the null
    block that padding points at, is zeroed at once."""

    def __init__(self, like, num_blocks: int, static: bool = False, dtype: torch.dtype | None = None):
        self.num_blocks = num_blocks
        self.static = static  # a compiled step on CUDA: the storage never moves (its graphs hold the addresses)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for layer in like.layers:
            for name, out in (("keys", self.keys), ("values", self.values)):
                one = getattr(layer, name)  # (1, heads, 1, dim)
                shape = (num_blocks * BLOCK, one.shape[1], one.shape[3])
                tensor = torch.empty(shape, dtype=dtype or one.dtype, device=one.device)
                if static:
                    torch._dynamo.mark_static_address(tensor)
                out.append(tensor)
        self.touched = 0  # blocks zeroed so far
        self.touch(1)

    def touch(self, fresh: int) -> None:
        """Zero the blocks below ``fresh`` not zeroed yet (they are being handed out for the first time)."""
        if fresh <= self.touched:
            return
        start, end = self.touched * BLOCK, fresh * BLOCK
        for tensor in (*self.keys, *self.values):
            tensor[start:end].zero_()
        self.touched = fresh

    def copy_block(self, source: int, target: int) -> None:
        for tensor in (*self.keys, *self.values):
            tensor[target * BLOCK : (target + 1) * BLOCK] = tensor[source * BLOCK : (source + 1) * BLOCK]

    def compacted(self, kept: list[int]) -> "KVPool":
        """A new pool holding only the blocks ``kept`` (as blocks 1, 2, ...): this one's storage can go."""
        new = object.__new__(KVPool)
        new.num_blocks, new.static, new.touched = self.num_blocks, self.static, 0
        new.keys = [torch.empty_like(t) for t in self.keys]
        new.values = [torch.empty_like(t) for t in self.values]
        new.touch(len(kept) + 1)
        if kept:
            index = (torch.tensor(kept).view(-1, 1) * BLOCK + torch.arange(BLOCK)).view(-1)
            for old, fresh in zip((*self.keys, *self.values), (*new.keys, *new.values)):
                fresh[BLOCK : (len(kept) + 1) * BLOCK] = old[index.to(old.device)]
        return new

    def bytes_touched(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in (*self.keys, *self.values)) * self.touched * BLOCK
