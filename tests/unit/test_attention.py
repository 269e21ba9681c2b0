"""The engine's CPU attention (``app/engine/model/attention.py``) against PyTorch's SDPA math, and its point: a query's
output does not depend on how many queries came with it."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from app.engine.model.attention import TILE
from app.engine.model.attention import exact_attention as attention

MODULE = types.SimpleNamespace(is_causal=True)


def sdpa(query, key, value, mask=None, causal=False):
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(query.double(), key.double(), value.double(), attn_mask=mask, is_causal=causal)
    return out.float().transpose(1, 2)


@pytest.mark.parametrize("queries, keys", [(1, 1), (1, 37), (5, 5), (5, 40), (TILE + 3, TILE + 10)])
def test_causal_without_a_mask_is_sdpa_causal_over_the_last_keys(queries, keys):
    torch.manual_seed(queries * 1000 + keys)
    q, k, v = torch.randn(2, 6, queries, 16), torch.randn(2, 2, keys, 16), torch.randn(2, 2, keys, 16)
    # query i sits at key position keys - queries + i
    allowed = torch.arange(keys).view(1, -1) <= torch.arange(keys - queries, keys).view(-1, 1)
    out, _ = attention(MODULE, q, k, v, None)
    torch.testing.assert_close(out, sdpa(q, k, v, mask=allowed), atol=1e-6, rtol=1e-5)


def test_a_boolean_mask_per_row_hides_its_keys():
    torch.manual_seed(1)
    q, k, v = torch.randn(3, 4, 1, 8), torch.randn(3, 2, 20, 8), torch.randn(3, 2, 20, 8)
    lengths = torch.tensor([3, 20, 11])
    mask = (torch.arange(20).view(1, -1) < lengths.view(-1, 1)).view(3, 1, 1, 20)
    out, _ = attention(MODULE, q, k, v, mask)
    torch.testing.assert_close(out, sdpa(q, k, v, mask=mask), atol=1e-6, rtol=1e-5)
    # keys a row may not see change nothing in it
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 3:], v2[0, :, 3:] = 100.0, -100.0
    assert torch.equal(attention(MODULE, q, k2, v2, mask)[0][0], out[0])


def test_a_query_gets_the_same_bits_alone_in_a_chunk_or_in_a_prefill():
    """SDPA's float32 kernels do not promise this (their products block differently for 1 and for many queries);
    the engine's attention does: every position of a prefill equals the same position computed alone after the
    keys before it, and chunked at any size."""
    torch.manual_seed(2)
    n = 300
    q, k, v = torch.randn(1, 9, n, 64), torch.randn(1, 3, n, 64), torch.randn(1, 3, n, 64)
    whole, _ = attention(MODULE, q, k, v, None)
    for at in (0, 1, 45, 255, 256, 299):
        alone, _ = attention(MODULE, q[:, :, at : at + 1], k[:, :, : at + 1], v[:, :, : at + 1], None)
        assert torch.equal(alone[0, 0], whole[0, at]), at
    for size in (7, 64):
        parts = [
            attention(MODULE, q[:, :, s : s + size], k[:, :, : s + size], v[:, :, : s + size], None)[0]
            for s in range(0, n, size)
        ]
        assert torch.equal(torch.cat(parts, dim=1), whole), size
