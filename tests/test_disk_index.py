"""The scheduler's side of the disk tier (scheduler/disk_tier.py) over a real trie and
allocator: a finished request's blocks are named with the trie's slots; a load brings
the blocks after the pool match, keeps the slot accounting whole when the worker loads
only some, and forgets refused and dropped keys."""

from __future__ import annotations

from common.kv_store.block_keys import block_key, block_keys, root_key, state_key
from common.messages import BlocksLoaded, DiskReport, SamplingParams, WorkerError
from scheduler.cache import KVCacheManager
from scheduler.disk_tier import DiskIndex
from scheduler.request import Req

B = 8


def _finished(kv: KVCacheManager, disk: DiskIndex, rid: str, tokens: list[int]) -> None:
    """A request whose prompt `tokens` ran and finished (its KV goes to the trie)."""
    req = Req(rid, tokens, SamplingParams(max_new_tokens=1))
    kv.admit(req, len(tokens))
    kv.release(req, keep=True)
    disk.save_finished(kv, req, tokens)


def _check(kv: KVCacheManager) -> None:
    kv.check_invariants([])


def test_finished_blocks_are_named_with_the_trie_slots_once():
    kv, disk = KVCacheManager(64, 4, False, debug=True), DiskIndex([], B)
    tokens = list(range(100, 120))  # two whole blocks and a tail
    _finished(kv, disk, "a", tokens)
    saves, touched = disk.take_saves()
    assert touched == []
    keys = block_keys(tokens, 0, B)
    tail = block_key(keys[1], tokens[2 * B :])  # the 4 tokens after them: a short block
    assert [s.key for s in saves] == [*keys, tail]
    assert saves[0].parent == root_key(0) and saves[1].parent == keys[0]
    assert saves[1].tokens == tokens[B : 2 * B]
    assert (saves[2].parent, saves[2].tokens) == (keys[1], tokens[2 * B :])
    assert sum((x.slots for x in saves), []) == kv.tree.match_prefix(tokens).slot_ids
    _finished(kv, disk, "b", tokens)  # the same blocks and tail: not asked again, touched
    assert disk.take_saves() == ([], keys)
    _finished(kv, disk, "c", tokens + [7])  # the same blocks, a longer tail: only it
    saves, touched = disk.take_saves()
    assert [(s.key, s.tokens) for s in saves] == [(block_key(keys[1], tokens[2 * B :] + [7]),
                                                   tokens[2 * B :] + [7])]  # fmt: skip
    assert touched == keys


def test_a_tail_continues_the_next_turn_and_is_forgotten_when_dropped():
    kv, disk = KVCacheManager(64, 4, False, debug=True), DiskIndex([], B)
    turn1 = list(range(500, 519))  # two whole blocks and a 3-token tail
    _finished(kv, disk, "a", turn1)
    disk.take_saves()
    kv.tree.evict(64)  # the pool forgets it: the next turn comes from disk
    turn2 = turn1 + [1, 2, 3, 4, 5, 6, 7]
    req = Req("r", turn2, SamplingParams(max_new_tokens=4))
    [plan] = disk.plan([req], kv)
    keys = block_keys(turn1, 0, B)
    tail = block_key(keys[1], turn1[2 * B :])
    assert [(x.key, x.offset, len(x.slots)) for x in plan.loads] == [
        (keys[0], 0, B), (keys[1], 0, B), (tail, 0, 3),
    ]  # fmt: skip
    disk.loaded(kv, [plan], BlocksLoaded(1, loaded=3))
    _check(kv)
    assert len(kv.tree.match_prefix(turn2).slot_ids) == len(turn1) and req.disk_tokens == 19
    disk.on_report(DiskReport(0, 0, dropped=[tail]))
    assert disk.tails == {} and disk.tail_parents == {}
    again = Req("s", turn2, SamplingParams(max_new_tokens=4))
    kv.tree.evict(64)
    [plan] = disk.plan([again], kv)
    assert [x.key for x in plan.loads] == keys  # whole blocks only now


def test_load_after_a_partial_pool_match_and_a_refused_block():
    tokens = list(range(200, 226))  # three whole blocks (the load leaves the last token)
    keys = block_keys(tokens[:-1], 0, B)
    kv, disk = KVCacheManager(64, 4, False, debug=True), DiskIndex(keys, B)
    kv.tree.insert(tokens[:5], kv.allocator.alloc(5))  # the pool holds 5 tokens of block 0
    req = Req("r", tokens, SamplingParams(max_new_tokens=4))
    [plan] = disk.plan([req], kv)
    assert [(x.key, x.offset, len(x.slots)) for x in plan.loads] == [
        (keys[0], 5, 3), (keys[1], 0, B), (keys[2], 0, B),
    ]  # fmt: skip
    assert disk.plan([req], kv) == []  # looked at once
    disk.loaded(kv, [plan], BlocksLoaded(1, loaded=2))  # block 2 was refused
    _check(kv)
    assert len(kv.tree.match_prefix(tokens).slot_ids) == 2 * B
    assert req.disk_tokens == 2 * B - 5
    assert keys[2] not in disk.keys and keys[1] in disk.keys


def test_failed_load_frees_everything_and_dropped_keys_are_forgotten():
    tokens = list(range(300, 320))
    keys = block_keys(tokens[:-1], 0, B)
    kv, disk = KVCacheManager(64, 4, False, debug=True), DiskIndex(keys, B)
    free = kv.allocator.available_size()
    planned = disk.plan([Req("r", tokens, SamplingParams(max_new_tokens=4))], kv)
    disk.loaded(kv, planned, WorkerError(1, "load failed"))
    assert kv.allocator.available_size() == free
    _check(kv)
    disk.on_report(DiskReport(0, 0, dropped=[keys[0]]))
    assert keys[0] not in disk.keys and disk.take_reports()


def test_two_prompts_of_one_prefix_load_it_once():
    shared = list(range(400, 416))
    keys = block_keys(shared, 0, B)
    kv, disk = KVCacheManager(64, 4, False, debug=True), DiskIndex(keys, B)
    a = Req("a", shared + [1, 2], SamplingParams(max_new_tokens=4))
    b = Req("b", shared + [3, 4], SamplingParams(max_new_tokens=4))
    planned = disk.plan([a, b], kv)
    assert [p.req for p in planned] == [a] and not b.disk_checked
    assert b.disk_deferred and not a.disk_deferred  # admitted now, b would recompute them
    disk.loaded(kv, planned, BlocksLoaded(1, loaded=2))
    assert disk.plan([b], kv) == []  # b now matches them in the pool
    assert not b.disk_deferred
    assert len(kv.tree.match_prefix(b.input_ids).slot_ids) == 2 * B
    _check(kv)


def test_prefetch_takes_at_most_half_the_pool_ahead_of_admission():
    a_tokens, b_tokens = list(range(500, 525)), list(range(600, 625))  # 3 blocks each
    keys = block_keys(a_tokens[:-1], 0, B) + block_keys(b_tokens[:-1], 0, B)
    kv, disk = KVCacheManager(64, 4, False, debug=True), DiskIndex(keys, B)
    a = Req("a", a_tokens, SamplingParams(max_new_tokens=4))
    b = Req("b", b_tokens, SamplingParams(max_new_tokens=4))
    planned = disk.plan([a, b], kv)
    assert [p.req for p in planned] == [a] and not b.disk_checked  # 24 + 24 > 64 / 2
    assert b.disk_deferred  # b waits for the room a's admission frees, not recomputes
    assert disk.plan([a, b], kv) == [] and b.disk_deferred  # a's load is in flight
    disk.loaded(kv, planned, BlocksLoaded(1, loaded=3))
    assert disk.plan([a, b], kv) == [] and b.disk_deferred  # a's blocks await admission
    a.cached_tokens = 24  # admitted
    assert [p.req for p in disk.plan([b], kv)] == [b] and not b.disk_deferred


def test_a_prompt_with_nothing_ahead_of_it_is_never_held_back():
    tokens = list(range(700, 725))
    keys = block_keys(tokens[:-1], 0, B)
    kv, disk = KVCacheManager(16, 4, False, debug=True), DiskIndex(keys, B)  # no room
    req = Req("r", tokens, SamplingParams(max_new_tokens=4))
    assert disk.plan([req], kv) == [] and not req.disk_deferred  # no load would free any


def _recurrent(keys: list[str]) -> tuple[KVCacheManager, DiskIndex]:
    """A recurrent model's cache (state slots) with the tier's block snapshots on."""
    kv = KVCacheManager(96, 4, False, debug=True, num_state_slots=8)
    kv.block_tokens = B
    return kv, DiskIndex(keys, B, states=True)


def test_recurrent_prompt_snapshots_its_last_block_end_and_saves_it():
    kv, disk = _recurrent([])
    tokens = list(range(700, 722))  # two whole blocks and a tail: block end 16
    req = Req("a", tokens, SamplingParams(max_new_tokens=1))
    adm = kv.admit(req, len(tokens))
    assert [at for at, _ in adm.snapshots] == [16, 21]  # the block end, all but the last
    kv.cache_unfinished(req)
    kv.release(req, keep=True)
    disk.save_finished(kv, req, tokens)
    saves, _ = disk.take_saves()
    snapshot = kv.tree.match_snapshot(tokens[:16]).snapshot
    assert [s.state_slot for s in saves] == [0, snapshot] and snapshot
    assert state_key(saves[1].key) in disk.keys and state_key(saves[0].key) not in disk.keys
    kv.check_invariants([])


def test_recurrent_load_stops_at_the_last_stored_state_and_resumes_there():
    tokens = list(range(800, 834))  # four whole blocks of the head
    keys = block_keys(tokens[:-1], 0, B)
    kv, disk = _recurrent(keys + [state_key(keys[1])])  # a state after block 1 only
    req = Req("r", tokens, SamplingParams(max_new_tokens=4))
    [plan] = disk.plan([req], kv)
    assert [x.key for x in plan.loads] == keys[:2]
    state = plan.loads[-1].state_slot
    assert state and plan.loads[0].state_slot == 0
    kv.check_invariants([], [s for x in plan.loads for s in x.slots], [state])
    disk.loaded(kv, [plan], BlocksLoaded(1, loaded=2))
    kv.check_invariants([])
    m = kv.tree.match_snapshot(tokens[:-1])
    assert (len(m.slot_ids), m.snapshot) == (2 * B, state)  # admission resumes there


def test_recurrent_load_cut_short_frees_its_state_slot():
    tokens = list(range(900, 918))
    keys = block_keys(tokens[:-1], 0, B)
    kv, disk = _recurrent(keys + [state_key(k) for k in keys])
    free = kv.states.available_size()
    [plan] = disk.plan([Req("r", tokens, SamplingParams(max_new_tokens=4))], kv)
    disk.loaded(kv, [plan], BlocksLoaded(1, loaded=1))  # the last block (or its state) failed
    kv.check_invariants([])
    assert kv.states.available_size() == free
    assert kv.tree.match_snapshot(tokens).snapshot == 0  # KV without a state: not resumed
    assert keys[1] not in disk.keys and state_key(keys[1]) not in disk.keys


def test_recurrent_pool_kv_past_its_last_snapshot_is_loaded_again_with_the_state():
    tokens = list(range(1000, 1018))
    keys = block_keys(tokens[:-1], 0, B)
    kv, disk = _recurrent(keys + [state_key(keys[1])])
    kv.tree.insert(tokens[:12], kv.allocator.alloc(12))  # KV, no snapshot: not resumable
    [plan] = disk.plan([Req("r", tokens, SamplingParams(max_new_tokens=4))], kv)
    assert [(x.offset, len(x.slots)) for x in plan.loads] == [(0, B), (0, B)]
    disk.loaded(kv, [plan], BlocksLoaded(1, loaded=2))
    kv.check_invariants([])  # the loaded copies of the pool's 12 tokens were freed
    assert len(kv.tree.match_snapshot(tokens[:-1]).slot_ids) == 2 * B


def test_recurrent_blocks_used_again_touch_their_stored_states_too():
    tokens = list(range(1100, 1118))
    keys = block_keys(tokens, 0, B)
    kv, disk = _recurrent(keys + [state_key(keys[1])])
    _finished(kv, disk, "a", tokens)
    _, touched = disk.take_saves()
    assert set(keys) | {state_key(keys[1])} <= set(touched)  # a hot prefix keeps its state
