"""The KV ledger: each decoding request's slots, its decode-buffer row and the flush rule."""

from __future__ import annotations

import random

import pytest

from common.messages import ReleaseReq
from tests.test_model_runner import Harness, random_prompt


def _pool(num_slots: int = 32):
    import mlx.core as mx

    from worker_mlx.kv_pool import KVLayout, MlxKVPool

    return MlxKVPool(KVLayout(num_layers=1, n_kv_heads=1, head_dim=4, dtype=mx.float32), num_slots)


def test_open_add_release():
    from worker_mlx.kv_ledger import KVLedger

    ledger = KVLedger(_pool())
    prefix = [3, 4, 5]
    ledger.open("a", prefix, state_slot=2)
    prefix.append(9)  # the ledger keeps its own list
    ledger.add("a", [6])
    ledger.add("a", [7, 8])
    assert ledger.slots("a") == [3, 4, 5, 6, 7, 8] and "a" in ledger
    where = ledger.where("a")  # no decode buffer: all of it in the pool
    assert (where.pool_slots, where.buffered_slots, where.row) == ([3, 4, 5, 6, 7, 8], [], None)
    assert where.state_slot == 2
    ledger.release([ReleaseReq("a", flush=True)])
    ledger.release([ReleaseReq("a", flush=False)])  # released twice (an abort after a finish)
    assert "a" not in ledger
    with pytest.raises(KeyError):
        ledger.slots("a")


def test_a_pool_read_before_the_flush_fails(tiny_model):
    """With decode KV only in the buffer, a read of the pool that does not go through the
    ledger raises StaleRead (it would read slots that hold nothing yet); the ledger's
    `readable_pool` flushes first, and the pool then holds every token's KV."""
    import mlx.core as mx

    from worker_mlx.decode_buffer import DecodeBuffer
    from worker_mlx.kv_pool import StaleRead

    h = Harness(tiny_model)
    h.extend([h.ereq("X", random_prompt(random.Random(2), 7, h.vocab))])
    for _ in range(3):
        h.decode()
    ledger, pool = h.runner.ledger, h.pool
    assert ledger.unflushed() == 3
    where = ledger.where("X")
    assert where.buffered_slots == h.slots["X"][-3:] and where.row == 0
    idx = pool.head_index(mx.array([h.slots["X"]]))
    with pytest.raises(StaleRead):
        pool.gather_heads(0, idx)
    with pytest.raises(StaleRead):  # a second buffer gathered around the ledger
        DecodeBuffer(pool, ["X"], [h.slots["X"]])
    assert ledger.readable_pool() is pool and ledger.unflushed() == 0
    assert ledger.where("X").buffered_slots == []
    pool.gather_heads(0, idx)
    h.assert_pool_holds("X")
