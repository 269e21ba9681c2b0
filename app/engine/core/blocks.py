"""The KV cache's bookkeeping: which blocks of the pool (``kv_cache.KVPool``) each sequence holds, how many holders
each block has, and which full blocks of prompt tokens are kept for reuse (prefix caching). Plain Python: no
tensors, no model.

A block holds ``BLOCK`` consecutive positions of one sequence. A sequence's block table lists its blocks in order;
position ``p`` lives at slot ``table[p // BLOCK] * BLOCK + p % BLOCK`` of the pool. Block 0 is never handed out:
it is the null block that padding points at.

Prefix caching: a full block of prompt tokens is named by a chained key, ``(hash of the previous block's key, salt,
its tokens)``, so equal keys mean equal prompts up to the block's end (the chain is checked by dict equality of the
last block's tokens and the previous key's 64-bit hash). A new prompt takes the blocks of its longest cached run of
leading full blocks (their holders go up by one; no KV is copied) and computes the rest. A block whose last holder
let go stays cached (least recently released first out) until a fresh block is needed or more than
``cached_limit`` blocks are cached with no holder.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from app.engine.model.kv_cache import BLOCK

Key = tuple  # (previous key's hash, salt, tokens)


class NoFreeBlocks(Exception):
    """Every block of the pool is held (admission keeps this from happening to running sequences)."""


class BlockManager:
    def __init__(self, num_blocks: int, cached_limit: int = 0):
        self.num_blocks = max(2, num_blocks)  # block 0 is the null block
        self.cached_limit = cached_limit  # cached blocks kept with no holder (0: prefix caching off)
        self.refs: dict[int, int] = {}  # held blocks -> holders
        self._free: list[int] = []  # a heap of released blocks with no cached content: the lowest first
        self.fresh = 1  # blocks below this have been handed out at least once (the pool's touched part)
        self._cached: dict[Key, int] = {}  # key -> block
        self._key_of: dict[int, Key] = {}  # block -> key, for cached blocks
        self._idle: OrderedDict[int, None] = (
            OrderedDict()
        )  # cached blocks with no holder, least recently released first
        # counters (prefix caching): prompts that reused blocks, tokens reused, tokens looked up
        self.hits = 0
        self.reused_tokens = 0
        self.queried_tokens = 0

    # -- handing blocks out ---------------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        """Blocks that can be handed out now (free, never used, or cached with no holder)."""
        return len(self._free) + (self.num_blocks - self.fresh) + len(self._idle)

    @property
    def held_blocks(self) -> int:
        return len(self.refs)

    def allocate(self, count: int = 1) -> list[int]:
        """``count`` blocks with one holder each: released ones first (lowest first), then never used ones, then
        cached ones with no holder (least recently released first; they leave the prefix cache)."""
        if count > self.free_blocks:
            raise NoFreeBlocks(f"{count} blocks wanted, {self.free_blocks} free of {self.num_blocks}")
        out = []
        for _ in range(count):
            if self._free:
                block = heapq.heappop(self._free)
            elif self.fresh < self.num_blocks:
                block = self.fresh
                self.fresh += 1
            else:
                block, _ = self._idle.popitem(last=False)
                self._forget(block)
            self.refs[block] = 1
            out.append(block)
        return out

    def share(self, blocks: list[int]) -> None:
        """One more holder for each of ``blocks`` (a candidate sharing its prompt's full blocks)."""
        for block in blocks:
            if block in self.refs:
                self.refs[block] += 1
            else:  # a cached block with no holder
                self._idle.pop(block)
                self.refs[block] = 1

    def release(self, blocks: list[int]) -> None:
        """One holder less for each of ``blocks``; a block with none left is free again (kept in the prefix cache
        when it is a cached one)."""
        for block in blocks:
            left = self.refs[block] - 1
            if left:
                self.refs[block] = left
                continue
            del self.refs[block]
            if block in self._key_of and self.cached_limit:
                self._idle[block] = None
            else:
                self._forget(block)
                heapq.heappush(self._free, block)
        while len(self._idle) > self.cached_limit:
            block, _ = self._idle.popitem(last=False)
            self._forget(block)
            heapq.heappush(self._free, block)

    # -- prefix caching ---------------------------------------------------------------------------------------------
    @staticmethod
    def keys(tokens: list[int], salt: object = "", limit: int | None = None) -> list[Key]:
        """The chained keys of the full blocks of ``tokens`` (at most ``limit`` of them)."""
        count = len(tokens) // BLOCK if limit is None else min(limit, len(tokens) // BLOCK)
        out: list[Key] = []
        previous = 0
        for i in range(count):
            key = (previous, salt, tuple(tokens[i * BLOCK : (i + 1) * BLOCK]))
            out.append(key)
            previous = hash(key)
        return out

    def lookup(self, keys: list[Key], queried: int) -> list[int]:
        """The cached blocks of the longest leading run of ``keys``, each with one more holder (``queried``: the
        prompt tokens this lookup counts as looked up)."""
        if not self.cached_limit:
            return []
        self.queried_tokens += queried
        found = []
        for key in keys:
            block = self._cached.get(key)
            if block is None:
                break
            found.append(block)
        if found:
            self.share(found)
            self.hits += 1
            self.reused_tokens += len(found) * BLOCK
        return found

    def register(self, block: int, key: Key) -> None:
        """``block`` now holds the full block named ``key``: later prompts may take it."""
        if not self.cached_limit or key in self._cached or block in self._key_of:
            return
        self._cached[key] = block
        self._key_of[block] = key

    def _forget(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None and self._cached.get(key) == block:
            del self._cached[key]

    @property
    def cached_tokens(self) -> int:
        """Prompt positions whose KV the prefix cache holds now (held or not)."""
        return len(self._key_of) * BLOCK

    def clear_cached(self) -> None:
        """Forget every cached block (memory is short): those with no holder are free again."""
        for block in list(self._idle):
            heapq.heappush(self._free, block)
        self._idle.clear()
        self._cached.clear()
        self._key_of.clear()

    def compact(self) -> list[int]:
        """With nothing held: renumber the cached blocks 1, 2, ... (least recently released first) and return
        their old numbers in that order, so that the pool can keep just them (``KVPool.compacted``)."""
        assert not self.refs, "blocks are held"
        kept = list(self._idle)
        new_of = {old: i + 1 for i, old in enumerate(kept)}
        self._idle = OrderedDict((new_of[old], None) for old in kept)
        self._key_of = {new_of[old]: self._key_of[old] for old in kept}
        self._cached = {key: block for block, key in self._key_of.items()}
        self._free, self.fresh = [], len(kept) + 1
        return kept

    def reset(self) -> None:
        """Nothing is held or cached any more (the pool was given back); the counters stay."""
        self.refs.clear()
        self._free = []
        self.fresh = 1
        self._cached.clear()
        self._key_of.clear()
        self._idle.clear()
