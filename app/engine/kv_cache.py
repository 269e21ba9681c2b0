"""A KV-cache layer that appends in place.

transformers' ``DynamicLayer`` grows by ``torch.cat``: every decode step copies the whole cache of every layer.
``GrowingLayer`` keeps keys and values in a buffer with room to spare and writes each new token into it; the
model sees views of the filled part. Anything that replaces ``keys``/``values`` from outside (batch selection,
the batch's left padding, trimming, a row taken out of a prefill of several prompts) is noticed at the next
update and copied into a fresh buffer.
"""

from __future__ import annotations

import heapq

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicLayer

ROUND = 128  # buffer lengths are multiples of this


def _room(length: int) -> int:
    """Capacity for ``length`` tokens with room to grow (about 1.5x, at least one more round)."""
    want = length + max(ROUND, length // 2)
    return (want + ROUND - 1) // ROUND * ROUND


class GrowingLayer(DynamicLayer):
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._k_buf: torch.Tensor | None = None
        self._v_buf: torch.Tensor | None = None

    def _owned(self) -> bool:
        """Whether ``keys``/``values`` are still the filled part of our buffers."""
        buf = self._k_buf
        return (
            buf is not None
            and self.keys.numel() > 0
            and self.keys.data_ptr() == buf.data_ptr()
            and self.keys.shape[0] == buf.shape[0]
            and self.values.data_ptr() == self._v_buf.data_ptr()
        )

    def _rebuffer(self, needed: int) -> None:
        keys, values = self.keys, self.values
        length = keys.shape[-2] if keys.numel() else 0
        cap = _room(needed)
        shape = list(keys.shape) if keys.numel() else None
        if shape is None:
            return
        shape[-2] = cap
        self._k_buf = torch.empty(shape, dtype=keys.dtype, device=keys.device)
        self._v_buf = torch.empty(shape[:-1] + [values.shape[-1]], dtype=values.dtype, device=values.device)
        self._k_buf[..., :length, :] = keys
        self._v_buf[..., :length, :] = values
        self.keys = self._k_buf[..., :length, :]
        self.values = self._v_buf[..., :length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.keys.numel() == 0:  # first write: this is the prefill
            self.keys, self.values = key_states, value_states
            self._rebuffer(key_states.shape[-2])
            return self.keys, self.values
        length = self.keys.shape[-2]
        new = key_states.shape[-2]
        if not self._owned() or length + new > self._k_buf.shape[-2]:
            self._rebuffer(length + new)
        self._k_buf[..., length : length + new, :] = key_states
        self._v_buf[..., length : length + new, :] = value_states
        self.keys = self._k_buf[..., : length + new, :]
        self.values = self._v_buf[..., : length + new, :]
        return self.keys, self.values


def mergeable(cache) -> bool:
    """Caches whose layers are plain DynamicLayers can be padded and joined into one batch (or split by row)."""
    return all(type(layer).__name__ in ("DynamicLayer", "GrowingLayer") for layer in getattr(cache, "layers", [None]))


def use_growing_layers(cache) -> None:
    """Swap a fresh DynamicCache's plain layers for GrowingLayers (other layer kinds are left alone)."""
    layers = getattr(cache, "layers", None)
    if layers and all(type(layer) is DynamicLayer and not layer.is_initialized for layer in layers):
        cache.layers = [GrowingLayer() for _ in layers]


def growing_cache(config, keys: list[torch.Tensor], values: list[torch.Tensor]):
    """A fresh DynamicCache of GrowingLayers already holding these per-layer keys and values (views: they are
    copied into the layers' own buffers at the first update, so the tensors given are never written)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    use_growing_layers(cache)
    for layer, k, v in zip(cache.layers, keys, values):
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
    return cache


def kv_bytes_per_token(cache) -> int:
    """Bytes one token position takes in a prefilled cache (all layers, keys and values)."""
    return sum(
        layer.keys[0, :, 0].numel() * layer.keys.element_size()
        + layer.values[0, :, 0].numel() * layer.values.element_size()
        for layer in cache.layers
    )


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


# -- the decode batch's slot store ---------------------------------------------------------------------------------
class SlotLayer(CacheLayerMixin):
    """One layer's keys and values for every slot: (slots, kv heads, capacity, head dim), preallocated. A decode
    step writes each row's new key and value at that row's own position and hands attention a view of the first
    ``view`` positions of the first ``rows`` slots (the mask, built from per-row lengths, hides the rest)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, store: "SlotStore"):
        super().__init__()
        self.store = store
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        store = self.store
        rows, at = store.row_ids.to(self.keys.device), store.write_at.to(self.keys.device)
        self.keys[rows, :, at] = key_states[:, :, 0]
        self.values[rows, :, at] = value_states[:, :, 0]
        return self.keys[: store.rows, :, : store.view], self.values[: store.rows, :, : store.view]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.store.view, 0

    def get_seq_length(self) -> int:
        return self.store.view

    def get_max_length(self) -> int:
        return self.keys.shape[-2] if self.keys is not None else 0


class SlotStore:
    """Preallocated keys and values of the running batch: one slot per candidate row, written at per-row
    positions, so joining and leaving move no other row's data. A joining row's prefilled keys and values are
    written into its slot; a leaving row's slot is free at once (the lowest free slot is taken first, so the
    occupied slots stay near the front: a step runs over slots ``[0, high)``).

    Storage is allocated at the first join (each layer's on that layer's device, in its dtype) and grows, in
    place of a reallocation per join, when more slots or a longer row are needed (``ensure``)."""

    def __init__(self, budget: int | None = None):
        self.budget = budget  # token positions the storage should stay within (None: no bound)
        # a compiled step on CUDA: each storage tensor is marked a static address, so that the step's in-place
        # key/value writes are allowed inside a CUDA graph (inductor skips graphs that mutate other inputs)
        self.static = False
        self.layers: list[SlotLayer] = []
        self.cache = None
        self.slots = 0  # slots with storage
        self.wanted = 0  # slots handed out or free to hand out (storage follows at ``ensure``)
        self.capacity = 0  # positions per slot
        self._free: list[int] = []  # a heap: the lowest free slot first
        self.used: set[int] = set()
        # the step being run (set by ``prepare``)
        self.rows = 0
        self.view = 0
        self.row_ids: torch.Tensor | None = None
        self.write_at: torch.Tensor | None = None

    @property
    def high(self) -> int:
        """One past the highest slot in use."""
        return max(self.used) + 1 if self.used else 0

    def allocate(self, count: int) -> list[int]:
        """The ``count`` lowest free slots (more are made room for at the next ``ensure``)."""
        while len(self._free) < count:
            more = 8
            for slot in range(self.wanted, self.wanted + more):
                heapq.heappush(self._free, slot)
            self.wanted += more
        out = [heapq.heappop(self._free) for _ in range(count)]
        self.used.update(out)
        return out

    def reset(self) -> None:
        """Give the storage back (an idle batch): the next join sizes it for what it needs then, so a long request
        or a wide one does not leave its storage behind."""
        self.layers, self.cache = [], None
        self.slots = self.wanted = self.capacity = 0
        self._free, self.used = [], set()

    def release(self, slots: list[int]) -> None:
        for slot in slots:
            if slot in self.used:
                self.used.discard(slot)
                heapq.heappush(self._free, slot)

    def ensure(
        self, length: int, like: list[tuple[torch.Tensor, torch.Tensor]] | None = None, slots: int = 0, live: int = 0
    ) -> None:
        """Storage for every slot handed out so far (and at least ``slots``) with room for ``length`` positions
        each (``like``: per layer a keys and a values tensor to take head counts, dtypes and devices from, the
        first time; ``live``: the positions the longest running row already holds, which a resize keeps).

        With a budget, slots x capacity stays within it: the room to grow (about 1.5x) and the slots handed out
        ahead (8 at a time) are cut to what the budget leaves, down to what the rows need (admission keeps rows x
        their reach within the budget, so what they need fits)."""
        asked = slots
        while self.wanted < asked:
            heapq.heappush(self._free, self.wanted)
            self.wanted += 1
        need = max(length, live)
        if self.layers and self.wanted <= self.slots and need <= self.capacity:
            return
        slots = max(self.slots, self.wanted)
        capacity = self.capacity if need <= self.capacity else _room(need)
        if self.budget and slots * capacity > self.budget:
            capacity = max(need, self.budget // slots)
            if slots * capacity > self.budget:  # slots handed out ahead: keep only those in use (or asked for)
                slots = max(self.high, asked, 1)
                self._trim(slots)
                capacity = max(need, self.budget // slots)
        if not self.layers:
            from transformers import Cache

            self.layers = [SlotLayer(self) for _ in like]
            self.cache = Cache(layers=self.layers)
            for layer, (keys, values) in zip(self.layers, like):
                layer.keys = keys.new_zeros(0, keys.shape[1], 0, keys.shape[3])
                layer.values = values.new_zeros(0, values.shape[1], 0, values.shape[3])
        for layer in self.layers:
            for name in ("keys", "values"):
                old = getattr(layer, name)
                new = old.new_zeros(slots, old.shape[1], capacity, old.shape[3])
                keep_slots, keep_positions = min(slots, old.shape[0]), min(capacity, old.shape[2])
                new[:keep_slots, :, :keep_positions] = old[:keep_slots, :, :keep_positions]
                if self.static:
                    torch._dynamo.mark_static_address(new)
                setattr(layer, name, new)
        self.slots, self.capacity = slots, capacity

    def _trim(self, slots: int) -> None:
        """Hand out no slot at or past ``slots`` (none of them is in use)."""
        self.wanted = slots
        self._free = [slot for slot in self._free if slot < slots]
        heapq.heapify(self._free)

    def write(self, slots: list[int], layers, live: int = 0) -> int:
        """Write a prefilled cache (per layer keys/values of 1 row, or one row per slot) into ``slots``;
        returns its length (``live``: positions the longest running row holds, see ``ensure``)."""
        length = layers[0].keys.shape[-2]
        self.ensure(length + 1, [(layer.keys, layer.values) for layer in layers], live=live)
        index = torch.tensor(slots, dtype=torch.long, device=self.layers[0].keys.device)
        for slot_layer, layer in zip(self.layers, layers):
            at = index.to(slot_layer.keys.device)
            slot_layer.keys[at, :, :length] = layer.keys
            slot_layer.values[at, :, :length] = layer.values
        return length

    def prepare(self, rows: int, lengths: torch.Tensor, view: int) -> None:
        """The next step runs over slots ``[0, rows)``; row ``i`` writes at position ``lengths[i]`` and attends to
        positions ``[0, lengths[i]]`` of a ``view``-long window."""
        self.rows, self.view = rows, view
        self.row_ids = torch.arange(rows, device=lengths.device)
        self.write_at = lengths
