"""RadixCache snapshots: state slots on trie nodes (models with recurrent layers)."""

from __future__ import annotations

from scheduler.memory_pool import TokenToKVPoolAllocator
from scheduler.radix_cache import RadixCache


def make() -> tuple[TokenToKVPoolAllocator, TokenToKVPoolAllocator, RadixCache]:
    kv, states = TokenToKVPoolAllocator(64, debug=True), TokenToKVPoolAllocator(8, debug=True)
    return kv, states, RadixCache(kv, state_allocator=states)


def cache(tree: RadixCache, kv: TokenToKVPoolAllocator, tokens: list[int]) -> None:
    m = tree.match_prefix(tokens)
    slots = m.slot_ids + kv.alloc(len(tokens) - len(m.slot_ids))
    assert tree.insert(tokens, slots) == len(m.slot_ids)


def test_match_ends_at_the_deepest_snapshot_on_the_path():
    kv, states, tree = make()
    cache(tree, kv, [1, 2, 3, 4, 5, 6])
    assert tree.match_snapshot([1, 2, 3, 4, 5, 6]).slot_ids == []  # no snapshot: nothing
    [s2, s4] = states.alloc(2)
    assert tree.attach_snapshot([1, 2], s2) and tree.attach_snapshot([1, 2, 3, 4], s4)
    assert not tree.attach_snapshot([1, 2], 7)  # one snapshot per node
    assert not tree.attach_snapshot([1, 2, 9], 7)  # not cached
    m = tree.match_snapshot([1, 2, 3, 4, 5])
    assert (len(m.slot_ids), m.snapshot) == (4, s4) and m.last_node.snapshot == s4
    assert tree.match_snapshot([1, 2, 3, 7]).snapshot == s2  # diverges after 3: back to 2
    assert tree.match_snapshot([1, 2]).snapshot == s2
    m = tree.match_snapshot([1, 5])
    assert (m.slot_ids, m.snapshot, m.last_node) == ([], 0, tree.root)


def test_a_split_keeps_the_snapshot_on_the_lower_part():
    kv, states, tree = make()
    cache(tree, kv, [1, 2, 3, 4])
    [s] = states.alloc(1)
    assert tree.attach_snapshot([1, 2, 3, 4], s)
    upper = tree.match_prefix([1, 2]).last_node  # splits [1, 2 | 3, 4]
    assert upper.snapshot is None and [c.snapshot for c in upper.children.values()] == [s]
    assert tree.match_snapshot([1, 2, 3, 4, 5]).snapshot == s


def test_eviction_and_reset_free_snapshots():
    kv, states, tree = make()
    for seq in ([1, 2, 3], [1, 2, 4], [5, 6]):
        cache(tree, kv, seq)
        assert tree.attach_snapshot(seq, states.alloc(1)[0])
    assert tree.attach_snapshot([1, 2], states.alloc(1)[0])  # an inner node
    assert states.available_size() == 4 and len(tree.all_snapshots()) == 4
    locked = tree.match_prefix([1, 2, 4]).last_node
    tree.inc_lock_ref(locked)
    assert tree.evict(0, num_snapshots=1) == 1  # the LRU leaf [3] and its snapshot
    assert states.available_size() == 5
    assert tree.evict(0, num_snapshots=5) == 2  # [5, 6]; the locked path stays
    assert states.available_size() == 6
    tree.dec_lock_ref(locked)
    tree.reset()
    assert states.available_size() == 8 and kv.available_size() == 64
