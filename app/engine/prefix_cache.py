"""Prompt KV reuse: the keys and values of recent prompts, so that a prompt starting with one of them prefills
only the rest (a multi-turn chat resending its history, few-shot prompts sharing their examples).

Entries are keyed by (adapter, prompt token ids) and hold a copy of the prompt's per-layer keys and values
(batch row 1). A lookup finds the entry sharing the longest common prefix with a new prompt; at least
``MIN_REUSE`` tokens must match and at least one prompt token is always computed (its logits pick the first
token). The budget counts cached tokens; the least recently used entries go first. Keys and values computed
once are the same numbers a full prefill computes for those positions (to float rounding: the forward that
made them may have had another shape), so outputs stay within the engine's fidelity bound.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

MIN_REUSE = 16  # fewer shared tokens are not worth the copy


@dataclass
class Entry:
    tokens: tuple[int, ...]
    keys: list[torch.Tensor]  # per layer (1, heads, len, dim)
    values: list[torch.Tensor]


def common_prefix(a: tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[object, tuple[int, ...]], Entry] = OrderedDict()
        self.tokens = 0
        self.hits = 0
        self.reused_tokens = 0
        self.queried_tokens = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, adapter: object, prompt: list[int], touch: bool = True) -> tuple[Entry | None, int]:
        """The entry to reuse for ``prompt`` and how many of its tokens; (None, 0) when none is worth it.
        ``touch``: count it as a use (least recently used entries are dropped first)."""
        best, best_len = None, 0
        limit = len(prompt) - 1
        if touch:
            self.queried_tokens += len(prompt)
        for (entry_adapter, _), entry in self._entries.items():
            if entry_adapter != adapter:
                continue
            shared = min(common_prefix(entry.tokens, prompt), limit)
            if shared > best_len:
                best, best_len = entry, shared
        if best is None or best_len < MIN_REUSE:
            return None, 0
        if touch:
            self._entries.move_to_end((adapter, best.tokens))
            self.hits += 1
            self.reused_tokens += best_len
        return best, best_len

    def store(self, adapter: object, prompt: list[int], layers) -> None:
        """Keep a copy of a prompt's keys and values (``layers``: the cache layers of its prefill, row 0, the
        prompt's positions first). An entry the new prompt extends is replaced by it."""
        length = len(prompt)
        if self.max_tokens < length or length < MIN_REUSE:
            return
        tokens = tuple(prompt)
        key = (adapter, tokens)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        for entry_adapter, entry_tokens in list(self._entries):
            if entry_adapter == adapter and len(entry_tokens) < length and tokens[: len(entry_tokens)] == entry_tokens:
                self._remove((entry_adapter, entry_tokens))
        keys = [layer.keys[:1, :, :length].clone() for layer in layers]
        values = [layer.values[:1, :, :length].clone() for layer in layers]
        self._entries[key] = Entry(tokens, keys, values)
        self.tokens += length
        while self.tokens > self.max_tokens:
            self._remove(next(iter(self._entries)))

    def _remove(self, key) -> None:
        entry = self._entries.pop(key)
        self.tokens -= len(entry.tokens)

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0
