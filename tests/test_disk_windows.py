"""The disk tier's sliding-window rule over a real trie, allocator, pool and file store:
a block's sliding layers' KV goes to disk only within the window before a saved prefix's
ends, a load runs to the deepest block end whose window is stored and its other blocks
join the trie as windowless nodes, where no match ends, until a request's own KV of the
same tokens takes their place; the worker stores and reads those layers apart."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from common.kv_store.block_keys import block_key, block_keys, root_key, window_key
from common.kv_store.file_store import FileBlockStore
from common.messages import BlockLoad, BlockSave, BlocksLoaded, SamplingParams
from scheduler.cache import KVCacheManager
from scheduler.disk_tier import DiskIndex
from scheduler.request import Req
from scheduler.sliding_windows import windowed_end
from tests.test_kv_disk_worker import B, _answers, filled_pool
from worker_mlx.kv_disk import DiskTier
from worker_mlx.kv_pool import KVLayout, MlxKVPool

W = 12  # a window of one and a half blocks (B: 8-token blocks): the last two blocks before an end


def _kv() -> KVCacheManager:
    kv = KVCacheManager(128, 4, False, debug=True)
    kv.window = W
    return kv


def test_a_match_ends_only_after_a_whole_window_of_kv():
    assert windowed_end([], 30, W) == 30
    assert windowed_end([(0, 16)], 30, W) == 30  # 18..30 windowed
    assert windowed_end([(0, 20)], 30, W) == 0  # nothing after a whole window
    assert windowed_end([(0, 8), (30, 40)], 40, W) == 30  # back to 30: 18..30 windowed
    assert windowed_end([(0, 8), (24, 40)], 40, W) == 24  # 12..24 windowed
    assert windowed_end([(0, 8)], 10, W) == 0  # the window reaches back into 0..8


def test_windows_are_saved_before_the_prompts_last_block_end_and_the_end():
    kv, disk = _kv(), DiskIndex([], B, window=W)
    prompt = list(range(100, 141))  # five whole blocks of its head
    tokens = prompt + list(range(600, 620))  # and its output: seven whole blocks
    req = Req("a", prompt, SamplingParams(max_new_tokens=20))
    kv.admit(req, len(prompt))
    req.output_ids = tokens[len(prompt) :]
    kv.req_to_token.append("a", kv.alloc(len(tokens) - len(prompt)))
    kv.release(req, keep=True)
    disk.save_finished(kv, req, tokens)
    saves, _ = disk.take_saves()
    assert [s.window for s in saves] == [False, False, False, True, True, True, True]
    keys = block_keys(tokens, 0, B)
    assert {window_key(k) for k in keys[3:]} <= disk.keys
    assert window_key(keys[2]) not in disk.keys


def _load_all(kv: KVCacheManager, disk: DiskIndex, tokens: list[int]) -> Req:
    req = Req("r", tokens, SamplingParams(max_new_tokens=4))
    [plan] = disk.plan([req], kv)
    disk.loaded(kv, [plan], BlocksLoaded(1, loaded=len(plan.loads)))
    kv.check_invariants([])
    return req, plan


def test_a_load_ends_where_the_window_is_stored_and_marks_the_rest_windowless():
    tokens = list(range(200, 242))  # five whole blocks of its head
    keys = block_keys(tokens[:-1], 0, B)
    stored = [*keys, window_key(keys[1]), window_key(keys[2])]  # a saved prefix's end: 3
    kv, disk = _kv(), DiskIndex(stored, B, window=W)
    _, plan = _load_all(kv, disk, tokens)
    assert [x.window for x in plan.loads] == [False, True, True]  # to the end of block 2
    assert kv.tree.windowless_nodes == 1
    assert len(kv.match_head(tokens[:-1], 0).slot_ids) == 3 * B
    assert len(kv.match_head(tokens[: 2 * B], 0).slot_ids) == 0  # block 0 has no window
    # a request's own KV of those tokens takes the windowless node's place
    other = tokens[:B] + list(range(900, 916))
    req = Req("o", other, SamplingParams(max_new_tokens=1))
    kv.admit(req, len(other))
    assert req.cache_len == 0
    kv.cache_unfinished(req)
    assert kv.tree.windowless_nodes == 0 and len(req.dup_slots) == B  # the old slots
    kv.check_invariants([req])
    kv.release(req, keep=True)
    kv.check_invariants([])
    assert len(kv.match_head(other[:-1], 0).slot_ids) == len(other) - 1


def test_a_locked_windowless_node_keeps_its_slots():
    tokens = list(range(300, 342))
    keys = block_keys(tokens[:-1], 0, B)
    kv = _kv()
    disk = DiskIndex([*keys[:3], window_key(keys[1]), window_key(keys[2])], B, window=W)
    _load_all(kv, disk, tokens)
    first = Req("f", tokens, SamplingParams(max_new_tokens=1))
    kv.admit(first, len(tokens))  # matches all three blocks: block 0's node is locked
    assert first.cache_len == 3 * B
    kv.cache_unfinished(first)
    twin = Req("t", tokens[:B] + [7] * 9, SamplingParams(max_new_tokens=1))
    kv.admit(twin, 32)
    kv.cache_unfinished(twin)
    assert kv.tree.windowless_nodes == 1  # still windowless: `first` reads its slots
    kv.check_invariants([first, twin])
    kv.release(twin, keep=True)
    kv.release(first, keep=True)
    kv.check_invariants([])


def _window_pool() -> MlxKVPool:
    return filled_pool(KVLayout(2, 2, 16, mx.float32, windows=(W, None)))


def test_the_worker_stores_and_reads_the_sliding_layers_apart(tmp_path):
    pool = _window_pool()
    store = FileBlockStore(tmp_path, "fp", 1 << 24)
    tier = DiskTier(store, pool, B, verify=True)
    assert tier.window == W
    saves = []
    for i, window in enumerate((False, True)):
        tokens = list(range(10 + 10 * i, 10 + 10 * i + B))
        key = block_key(root_key(0), tokens)
        saves.append(BlockSave(key, root_key(0), tokens, list(range(1, B + 1)), window=window))
    tier.save(saves)
    tier.drain()
    plain, windowed = (s.key for s in saves)
    assert set(store.keys()) == {plain, windowed, window_key(windowed)}
    assert set(store.get(plain).arrays) == {"p0", "p1"}  # the global layer's K and V
    assert set(store.get(window_key(windowed)).arrays) == {"w0", "w1"}  # the windowed's
    before = np.array(pool.parts[0][0][30 : 30 + B])
    tier.submit(3, [BlockLoad(plain, 0, list(range(30, 30 + B)))])
    tier.submit(4, [BlockLoad(windowed, 0, list(range(40, 40 + B)), window=True)])
    answers = _answers(tier)
    if len(answers) < 2:
        answers += _answers(tier)
    assert [a.loaded for a in answers] == [1, 1]  # (and verified: --debug-invariants)
    assert np.array_equal(np.array(pool.parts[0][0][30 : 30 + B]), before)  # left as is
    for layer, loaded in ((0, [40]), (1, [30, 40])):  # the global layer: both blocks
        for part in pool.parts[layer]:
            for at in loaded:
                assert np.array_equal(np.array(part[at : at + B]), np.array(part[1 : B + 1]))


def test_a_load_over_windowless_nodes_brings_their_window():
    tokens = list(range(400, 442))  # five whole blocks of its head
    keys = block_keys(tokens[:-1], 0, B)
    kv = _kv()
    disk = DiskIndex([*keys, window_key(keys[3]), window_key(keys[4])], B, window=W)
    _load_all(kv, disk, tokens)  # blocks 0-2 windowless
    other = tokens[: 3 * B] + list(range(950, 960))
    assert len(kv.match_head(other[:-1], 0).slot_ids) == 0
    disk.keys |= {window_key(keys[1]), window_key(keys[2])}  # (another server saved them)
    req = Req("o", other, SamplingParams(max_new_tokens=1))
    [plan] = disk.plan([req], kv)
    assert [(x.offset, x.window) for x in plan.loads] == [(0, False), (0, True), (0, True)]
    disk.loaded(kv, [plan], BlocksLoaded(2, loaded=3))
    kv.check_invariants([])
    assert kv.tree.windowless_nodes == 1  # block 0 (the first load's; this one's freed)
    assert len(kv.match_head(other[:-1], 0).slot_ids) == 3 * B
    assert len(kv.match_head(tokens[:-1], 0).slot_ids) == 5 * B
