"""The trie's namespaces (cache salts) and priority prefixes (cache_control breakpoints)."""

from __future__ import annotations

from common.cache_salt import MAX_CACHE_SALT_CHARS, salt_namespace, salt_problem, salted_key
from scheduler.memory_pool import TokenToKVPoolAllocator
from scheduler.radix_cache import RadixCache
from tests.test_radix_cache import make, tree_contents

A, B = salt_namespace("tenant-a"), salt_namespace("tenant-b")


def put(cache: RadixCache, alloc: TokenToKVPoolAllocator, tokens: list[int], ns: int = 0):
    """Serve a request in namespace `ns` as the scheduler does; return the slots it reused."""
    m = cache.match_prefix(tokens, ns)
    own = alloc.alloc(len(tokens) - len(m.slot_ids))
    assert own is not None
    slots = m.slot_ids + own
    alloc.free(slots[len(m.slot_ids) : cache.insert(tokens, slots, ns)])
    return m.slot_ids


def test_salt_namespaces_are_negative_distinct_and_stable():
    assert salt_namespace(None) == salt_namespace("") == 0
    assert A < 0 and B < 0 and A != B and A == salt_namespace("tenant-a")
    assert A >= -(2**62)  # fits msgpack's int64 on the wire
    assert salted_key([5, 6], None) == [5, 6] and salted_key([5, 6], "tenant-a") == [A, 5, 6]
    assert salt_problem(None) is None and salt_problem("x") is None
    assert "string" in salt_problem(3) and "non-empty" in salt_problem("")
    assert "limit" in salt_problem("x" * (MAX_CACHE_SALT_CHARS + 1))


def test_salts_never_share_a_prefix_and_the_same_salt_does():
    alloc, cache = make(32)
    prompt = [1, 2, 3, 4]
    assert put(cache, alloc, prompt) == []
    assert put(cache, alloc, prompt, A) == []  # the unsalted copy is not A's
    assert put(cache, alloc, prompt, B) == []  # nor is A's B's
    assert len(put(cache, alloc, prompt, A)) == 4  # A's own hits
    assert len(put(cache, alloc, prompt)) == 4  # and the shared cache is still shared
    assert cache.total_size() == 12 and alloc.available_size() == 20
    # the namespace nodes hold no slot and no token count
    assert set(cache.root.children) == {1, A, B}
    assert cache.root.children[A].value == [] and cache.path_to(cache.root.children[A]) == [A]
    # a match in a namespace nobody used is empty, and locks nothing
    m = cache.match_prefix(prompt, salt_namespace("nobody"))
    assert m.slot_ids == [] and m.last_node is cache.root


def test_eviction_reports_namespace_paths_and_drops_empty_namespaces():
    alloc = TokenToKVPoolAllocator(32, debug=True)
    cache = RadixCache(alloc, report_evictions=True)
    put(cache, alloc, [1, 2], A)
    put(cache, alloc, [1, 3], A)
    put(cache, alloc, [7], B)
    node = cache.match_prefix([7], B).last_node
    cache.inc_lock_ref(node)  # B's stays: it is in use
    assert cache.evict(100) == 3
    assert A not in cache.root.children and B in cache.root.children
    # A went whole (its namespace node last): one path, the namespace itself
    assert cache.evicted_paths == [[A]]
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 1


def test_locked_empty_namespace_survives_eviction():
    alloc, cache = make(16)
    put(cache, alloc, [1], A)
    cache.evict(100)
    put(cache, alloc, [1], A)
    m = cache.match_prefix([9], A)  # nothing matched: the lock is on A's namespace node
    assert m.slot_ids == [] and m.last_node is cache.root.children[A]
    cache.inc_lock_ref(m.last_node)
    cache.evict(100)
    assert cache.root.children[A] is m.last_node  # still attached, so the unlock is sound
    cache.dec_lock_ref(m.last_node)
    cache.evict(100)
    assert not cache.root.children and alloc.available_size() == 16


def test_snapshots_stay_in_their_namespace():
    states = TokenToKVPoolAllocator(4, debug=True)
    alloc = TokenToKVPoolAllocator(16, debug=True)
    cache = RadixCache(alloc, state_allocator=states)
    put(cache, alloc, [1, 2, 3], A)
    assert cache.attach_snapshot([1, 2], states.alloc(1)[0], A)
    assert cache.match_snapshot([1, 2, 3], 0).slot_ids == []
    m = cache.match_snapshot([1, 2, 3], A)
    assert len(m.slot_ids) == 2 and m.snapshot and m.kv_len == 3
    cache.reset()
    assert states.available_size() == 4 and alloc.available_size() == 16


def test_marked_prefix_outlives_unmarked_leaves_lru_within_each_class():
    alloc, cache = make(64)
    put(cache, alloc, [1, 2, 3, 4, 5, 6])  # oldest; its first four are marked
    assert cache.mark_priority([1, 2, 3, 4]) == 4
    put(cache, alloc, [7, 8])
    put(cache, alloc, [9, 9])
    put(cache, alloc, [1, 2, 3, 4, 5, 6])  # the marked prompt is now the most recent
    # eviction takes the unmarked leaves first, oldest first: [5, 6] is the most recent
    # unmarked leaf, so [7, 8] then [9, 9] then [5, 6] go before the marked [1, 2, 3, 4]
    assert cache.evict(2) == 2
    assert cache.match_prefix([7, 8]).slot_ids == []
    assert cache.evict(4) == 4
    assert set(tree_contents(cache)) == {(1,), (1, 2), (1, 2, 3), (1, 2, 3, 4)}
    assert len(cache.match_prefix([1, 2, 3, 4, 5, 6]).slot_ids) == 4
    # only the marked prefix is left: it goes too when nothing else can
    assert cache.evict(1) == 4 and cache.total_size() == 0


def test_marks_cover_their_prefix_only_and_splits_keep_them():
    alloc, cache = make(64)
    put(cache, alloc, [1, 2, 3, 4], A)
    cache.mark_priority([1, 2], A)  # ends inside the edge: split there
    top = cache.match_prefix([1, 2], A).last_node
    assert top.priority and not top.children[3].priority
    assert cache.root.children[A].priority  # the namespace node is on the path
    put(cache, alloc, [1, 5], A)  # splits the marked edge: both halves stay marked
    assert cache.match_prefix([1], A).last_node.priority
    assert not cache.match_prefix([1, 5], A).last_node.priority
    assert cache.mark_priority([8, 8], A) == 0  # nothing cached: nothing marked
    assert cache.evict(3) == 3  # [3, 4] and [5]: the unmarked ones
    assert len(cache.match_prefix([1, 2, 3], A).slot_ids) == 2
