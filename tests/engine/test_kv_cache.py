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
    for step in range(2 * ROUND + 5):  # crosses the capacity at least once
        new = torch.randn(rows, 2, 1, 4), torch.randn(rows, 2, 1, 4)
        k1, v1 = ours.update(*new)
        k2, v2 = ref.update(*new)
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
        if step == 3:
            assert ours._k_buf is buffer, "appending within capacity does not reallocate"
        if step == 10:  # batch selection replaces the tensors from outside
            index = torch.tensor([2, 0])
            ours.batch_select_indices(index)
            ref.batch_select_indices(index)
            rows = 2
    assert ours.get_seq_length() == ref.get_seq_length() == 7 + 2 * ROUND + 5
    assert ours._k_buf.shape[-2] >= ours.get_seq_length()


def test_slot_store_joins_and_leaves_move_no_other_rows_data():
    """Rows are written into the lowest free slots; a leave frees its slot without touching the others; a new
    row takes the freed slot; storage grows (keeping contents) only when more slots or positions are needed."""
    from types import SimpleNamespace

    from app.engine.kv_cache import SlotStore

    torch.manual_seed(0)
    store = SlotStore()

    def prompt(rows, length):
        return [
            SimpleNamespace(keys=torch.randn(rows, 2, length, 4), values=torch.randn(rows, 2, length, 4))
            for _ in range(3)
        ]

    a, b = prompt(1, 5), prompt(2, 7)
    slots_a = store.allocate(1)
    store.write(slots_a, a)
    slots_b = store.allocate(2)
    store.write(slots_b, b)
    assert slots_a == [0] and slots_b == [1, 2]
    layer = store.layers[1]
    buffer = layer.keys.data_ptr()
    kept = layer.keys[1:3, :, :7].clone()
    store.release(slots_a)
    c = prompt(1, 3)
    slots_c = store.allocate(1)
    store.write(slots_c, c)
    assert slots_c == [0]  # the freed slot, lowest first
    assert layer.keys.data_ptr() == buffer  # no reallocation, nothing moved
    assert torch.equal(layer.keys[1:3, :, :7], kept)  # the other rows' keys untouched
    assert torch.equal(layer.keys[0, :, :3], c[1].keys[0])
    assert torch.equal(layer.values[1:3, :, :7], b[1].values)
    assert store.high == 3
    store.ensure(store.capacity + 1)  # a longer row: storage grows, contents stay
    assert layer.keys.data_ptr() != buffer
    assert torch.equal(layer.keys[1:3, :, :7], kept)
    one = prompt(1, 4)  # one prompt row written into several slots
    slots = store.allocate(9)
    store.write(slots, one)
    assert slots[0] == 3 and store.slots >= 12
    assert all(torch.equal(layer.keys[s, :, :4], one[1].keys[0]) for s in slots)
    assert torch.equal(layer.keys[1:3, :, :7], kept)


def test_slot_store_stays_within_its_budget_while_rows_join():
    """A long row, then short rows joining one by one (admission keeps rows x reach within the budget): the
    store's slots x capacity never passes the budget, although it hands out slots 8 at a time and gives rows
    room to grow; the long row's keys survive every resize."""
    from types import SimpleNamespace

    from app.engine.kv_cache import SlotStore

    torch.manual_seed(0)
    budget = 4096
    store = SlotStore(budget=budget)

    def prompt(length):
        return [
            SimpleNamespace(keys=torch.randn(1, 2, length, 4), values=torch.randn(1, 2, length, 4)) for _ in range(2)
        ]

    long = prompt(1000)
    store.write(store.allocate(1), long)
    assert store.slots * store.capacity <= budget
    live = 1001
    for joined in range(1, 4):  # 4 rows x 1001 positions fit 4096; the long row is the longest
        store.write(store.allocate(1), prompt(20), live=live)
        assert store.slots * store.capacity <= budget, (joined, store.slots, store.capacity)
        assert store.capacity >= live and store.slots >= store.high
        assert torch.equal(store.layers[1].keys[0, :, :1000], long[1].keys[0])


def test_an_idle_batch_gives_its_storage_back(gpt2_worker):
    """After a long request and then a wide one, the slot store holds nothing once the batch is idle (it would
    otherwise keep slots x the longest row ever seen: memory above the KV budget that never came back)."""
    from app.engine.params import SamplingParams

    worker = gpt2_worker
    worker.complete([worker.encode("Hello world " * 30)], SamplingParams(max_tokens=20, temperature=0.0), 256)
    worker.complete(
        [worker.encode("Hello")], SamplingParams(n=16, best_of=16, max_tokens=4, temperature=1.0, seed=1), 256
    )
    store = worker.scheduler.batch.store
    assert store.layers == [] and store.slots == 0 and store.capacity == 0 and not store.used


def test_top_k_beyond_the_vocabulary_is_all_of_it(gpt2_client):
    for top_k in (2**63, 10**30, 100_000):
        resp = gpt2_client.post(
            "/v1/completions",
            json={
                "model": "tiny-gpt2",
                "prompt": "Hello",
                "max_tokens": 2,
                "top_k": top_k,
                "temperature": 1.0,
                "seed": 1,
            },
        )
        assert resp.status_code == 200, resp.get_data(as_text=True)
