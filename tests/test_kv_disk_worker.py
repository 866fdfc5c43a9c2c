"""The worker's side of the disk tier (worker_mlx/kv_disk.py) over a real pool and the
file store: blocks saved from slots come back bit for bit into other slots (float and
quantized pools, from an offset into the block), and a slow read never holds up the
MLX thread (a step runs between `submit` and the answer)."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest

from common.kv_store.block_keys import block_key, root_key, state_key
from common.kv_store.file_store import FileBlockStore
from common.messages import BlockLoad, BlockSave
from worker_mlx import kv_disk
from worker_mlx.kv_disk import DiskTier
from worker_mlx.kv_pool import KVLayout, MlxKVPool
from worker_mlx.state_pool import StateLayout, StatePool

B = 8


def filled_pool(layout: KVLayout) -> MlxKVPool:
    """A 64-slot pool whose slots 1..B hold seeded K/V in every layer."""
    pool = MlxKVPool(layout, 64)
    rng = np.random.default_rng(0)
    shape = (B, layout.n_kv_heads, layout.head_dim)
    for layer in range(layout.num_layers):
        k, v = (mx.array(rng.standard_normal(shape).astype(np.float32)) for _ in "kv")
        pool.write(layer, mx.arange(1, B + 1), k, v)
    mx.eval(pool.arrays())
    return pool


def _pool(kv_cache_dtype: str) -> MlxKVPool:
    return filled_pool(KVLayout(2, 2, 64, mx.float32, kv_cache_dtype=kv_cache_dtype))


def _stored(pool: MlxKVPool, slots: list[int]) -> list[np.ndarray]:
    idx = mx.array(slots)
    return [np.array(p[idx]) for layer in pool.parts for p in layer]


def _answers(tier: DiskTier, timeout: float = 10.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = tier.install_ready()
        if got:
            return got
        time.sleep(0.01)
    raise AssertionError("the load was never answered")


@pytest.mark.parametrize("dtype", ["auto", "int8"])
def test_saved_block_loads_back_bit_for_bit(tmp_path, dtype):
    pool = _pool(dtype)
    tier = DiskTier(FileBlockStore(tmp_path, "fp", 1 << 24), pool, B)
    tokens = list(range(10, 10 + B))
    key = block_key(root_key(0), tokens)
    tier.save([BlockSave(key, root_key(0), tokens, list(range(1, B + 1)))])
    tier.drain()
    tier.submit(5, [BlockLoad(key, 0, list(range(20, 20 + B)))])
    [answer] = _answers(tier)
    assert (answer.step, answer.loaded) == (5, 1)
    for a, b in zip(_stored(pool, list(range(1, B + 1))), _stored(pool, list(range(20, 28)))):
        assert np.array_equal(a, b)
    tier.submit(6, [BlockLoad(key, 3, [40, 41, 42, 43, 44])])  # the pool held 3 tokens
    assert _answers(tier)[0].loaded == 1
    for a, b in zip(_stored(pool, list(range(4, B + 1))), _stored(pool, [40, 41, 42, 43, 44])):
        assert np.array_equal(a, b)
    report = tier.report()
    assert report.blocks == 1 and len(report.read_seconds) == 2 and len(report.write_seconds) == 1


def test_a_tail_and_blocks_load_in_one_batch_into_scattered_slots(tmp_path):
    """A request's tail (a block of fewer tokens) loads after a whole block in one
    LoadBatch, into slots that run in part (a slice copy) and in part not (a scatter);
    --debug-invariants reads every installed token back."""
    pool = _pool("int8")
    tier = DiskTier(FileBlockStore(tmp_path, "fp", 1 << 24), pool, B, verify=True)
    tokens = list(range(70, 70 + B + 3))
    key = block_key(root_key(0), tokens[:B])
    tail = block_key(key, tokens[B:])
    tier.save([BlockSave(key, root_key(0), tokens[:B], list(range(1, B + 1))),
               BlockSave(tail, key, tokens[B:], [1, 2, 3])])  # fmt: skip
    tier.drain()
    slots = [*range(20, 20 + B), 40, 45, 50]
    tier.submit(7, [BlockLoad(key, 0, slots[:B]), BlockLoad(tail, 1, slots[B + 1 :])])
    assert _answers(tier)[0].loaded == 2
    for a, b in zip(_stored(pool, [*range(1, B + 1), 2, 3]), _stored(pool, [*slots[:B], 45, 50])):
        assert np.array_equal(a, b)


class SlowStore(FileBlockStore):
    """A disk that takes half a second per read."""

    def get(self, key):
        time.sleep(0.5)
        return super().get(key)


def test_a_slow_read_does_not_hold_the_mlx_thread(tmp_path):
    pool = _pool("auto")
    tier = DiskTier(SlowStore(tmp_path, "fp", 1 << 24), pool, B)
    tokens = list(range(30, 30 + B))
    key = block_key(root_key(0), tokens)
    tier.save([BlockSave(key, root_key(0), tokens, list(range(1, B + 1)))])
    tier.drain()
    started = time.monotonic()
    tier.submit(1, [BlockLoad(key, 0, list(range(20, 20 + B))), BlockLoad("ab" * 16, 0, [30])])
    assert tier.install_ready() == [] and tier.loading == 1
    mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))  # a step meanwhile
    assert time.monotonic() - started < 0.25
    [answer] = _answers(tier)
    assert answer.loaded == 1 and tier.loading == 0  # the unknown block ends the load
    assert tier.report().errors == {"missing": 1}


def _states() -> StatePool:
    layout = StateLayout(((((3, 4), mx.float32), ((2, 5), mx.bfloat16)),))  # one layer
    states = StatePool(layout, 6)
    rng = np.random.default_rng(1)
    values = [
        mx.array(rng.standard_normal((1, *shape)).astype(np.float32))
        for shape, _ in layout.entries[0]
    ]
    states.write(0, mx.array([2]), values)
    mx.eval(states.all())
    return states


def test_a_state_after_a_block_loads_back_into_another_slot(tmp_path):
    """The state saved with a block (its own entry) comes back bit for bit into the load's
    state slot; --debug-invariants reads the installed block and state back."""
    pool, states = _pool("auto"), _states()
    tier = DiskTier(FileBlockStore(tmp_path, "fp", 1 << 24), pool, B, states, verify=True)
    tokens = list(range(50, 50 + B))
    key = block_key(root_key(0), tokens)
    tier.save([BlockSave(key, root_key(0), tokens, list(range(1, B + 1)), state_slot=2)])
    tier.drain()
    assert set(tier.store.keys()) == {key, state_key(key)}
    tier.submit(3, [BlockLoad(key, 0, list(range(20, 20 + B)), state_slot=5)])
    assert _answers(tier)[0].loaded == 1
    for a in states.all():
        assert np.array_equal(np.array(a[2].astype(mx.float32)), np.array(a[5].astype(mx.float32)))
        assert not np.array_equal(
            np.array(a[2].astype(mx.float32)), np.array(a[4].astype(mx.float32))
        )
    tier.store._forget(state_key(key), unlink=True)  # the state is gone: the block refused
    tier.submit(4, [BlockLoad(key, 0, list(range(30, 30 + B)), state_slot=4)])
    assert _answers(tier)[0].loaded == 0
    assert tier.report().errors == {"missing": 1}


def test_a_draft_models_kv_travels_in_the_same_block(tmp_path):
    """With a draft model (its pool has the same slot ids) a block holds both models'
    KV, and a load writes each into its own pool."""
    pool = _pool("auto")
    draft = MlxKVPool(KVLayout(1, 1, 32, mx.float32), 64)
    k = mx.array(np.random.default_rng(2).standard_normal((B, 1, 32)).astype(np.float32))
    draft.write(0, mx.arange(1, B + 1), k, -k)
    tier = DiskTier(FileBlockStore(tmp_path, "fp", 1 << 24), pool, B, verify=True, draft=draft)
    tokens = list(range(60, 60 + B))
    key = block_key(root_key(0), tokens)
    tier.save([BlockSave(key, root_key(0), tokens, list(range(1, B + 1)))])
    tier.drain()
    tier.submit(7, [BlockLoad(key, 2, list(range(30, 30 + B - 2)))])
    assert _answers(tier)[0].loaded == 1
    for p in (pool, draft):
        for a, b in zip(_stored(p, list(range(3, B + 1))), _stored(p, list(range(30, 36)))):
            assert np.array_equal(a, b) and a.any()


def test_debug_invariants_catch_a_block_installed_wrong(tmp_path, monkeypatch):
    """--debug-invariants reads every installed block back: a copy that did not land
    (here: the pool's write dropped) fails loudly instead of serving zeros."""
    pool = _pool("auto")
    tier = DiskTier(FileBlockStore(tmp_path, "fp", 1 << 24), pool, B, verify=True)
    tokens = list(range(70, 70 + B))
    key = block_key(root_key(0), tokens)
    tier.save([BlockSave(key, root_key(0), tokens, list(range(1, B + 1)))])
    tier.drain()
    monkeypatch.setattr(kv_disk, "_slot_runs", lambda slots: [])  # no row copied
    tier.submit(8, [BlockLoad(key, 0, list(range(40, 40 + B)))])
    with pytest.raises(AssertionError, match="the pool differs"):
        _answers(tier)
