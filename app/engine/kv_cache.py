"""A KV-cache layer that appends in place.

transformers' ``DynamicLayer`` grows by ``torch.cat``: every decode step copies the whole cache of every layer.
``GrowingLayer`` keeps keys and values in a buffer with room to spare and writes each new token into it; the
model sees views of the filled part. Anything that replaces ``keys``/``values`` from outside (batch selection,
the batch's left padding, trimming, a row taken out of a prefill of several prompts) is noticed at the next
update and copied into a fresh buffer.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

ROUND = 128          # buffer lengths are multiples of this


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
        return (buf is not None and self.keys.numel() > 0 and self.keys.data_ptr() == buf.data_ptr()
                and self.keys.shape[0] == buf.shape[0] and self.values.data_ptr() == self._v_buf.data_ptr())

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
        if self.keys.numel() == 0:                 # first write: this is the prefill
            self.keys, self.values = key_states, value_states
            self._rebuffer(key_states.shape[-2])
            return self.keys, self.values
        length = self.keys.shape[-2]
        new = key_states.shape[-2]
        if not self._owned() or length + new > self._k_buf.shape[-2]:
            self._rebuffer(length + new)
        self._k_buf[..., length:length + new, :] = key_states
        self._v_buf[..., length:length + new, :] = value_states
        self.keys = self._k_buf[..., :length + new, :]
        self.values = self._v_buf[..., :length + new, :]
        return self.keys, self.values


def mergeable(cache) -> bool:
    """Caches whose layers are plain DynamicLayers can be padded and joined into one batch (or split by row)."""
    return all(type(layer).__name__ in ("DynamicLayer", "GrowingLayer") for layer in getattr(cache, "layers", [None]))


def use_growing_layers(cache) -> None:
    """Swap a fresh DynamicCache's plain layers for GrowingLayers (other layer kinds are left alone)."""
    layers = getattr(cache, "layers", None)
    if layers and all(type(layer) is DynamicLayer and not layer.is_initialized for layer in layers):
        cache.layers = [GrowingLayer() for _ in layers]


def split_rows(cache, config, starts: list[int]) -> list:
    """One cache per row of a left-padded batch ``cache`` (plain dynamic layers): row ``i`` without its first
    ``starts[i]`` (padding) columns, as a fresh DynamicCache of GrowingLayers holding views of the batch's
    tensors (copied into their own buffers at their first update)."""
    return [growing_cache(config, [layer.keys[row:row + 1, :, start:] for layer in cache.layers],
                          [layer.values[row:row + 1, :, start:] for layer in cache.layers])
            for row, start in enumerate(starts)]


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
