"""GrowingLayer appends in place but must read exactly like transformers' DynamicLayer."""
from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from app.engine.kv_cache import ROUND, GrowingLayer


def test_growing_layer_matches_dynamic_layer_through_growth_and_outside_changes():
    torch.manual_seed(0)
    ours, ref = GrowingLayer(), DynamicLayer()
    first = torch.randn(3, 2, 7, 4), torch.randn(3, 2, 7, 4)
    for layer in (ours, ref):
        k, v = layer.update(*first)
    buffer = ours._k_buf
    rows = 3
    for step in range(2 * ROUND + 5):                    # crosses the capacity at least once
        new = torch.randn(rows, 2, 1, 4), torch.randn(rows, 2, 1, 4)
        k1, v1 = ours.update(*new)
        k2, v2 = ref.update(*new)
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
        if step == 3:
            assert ours._k_buf is buffer, "appending within capacity does not reallocate"
        if step == 10:                                   # batch selection replaces the tensors from outside
            index = torch.tensor([2, 0])
            ours.batch_select_indices(index)
            ref.batch_select_indices(index)
            rows = 2
    assert ours.get_seq_length() == ref.get_seq_length() == 7 + 2 * ROUND + 5
    assert ours._k_buf.shape[-2] >= ours.get_seq_length()
