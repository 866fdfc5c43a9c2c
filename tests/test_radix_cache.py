from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.memory_pool import TokenToKVPoolAllocator
from scheduler.radix_cache import MatchResult, RadixCache, TreeNode, _key_match_len

# ---- helpers ------------------------------------------------------------------------------------


def make(capacity: int = 64) -> tuple[TokenToKVPoolAllocator, RadixCache]:
    alloc = TokenToKVPoolAllocator(capacity, debug=True)
    return alloc, RadixCache(alloc)


def put(cache: RadixCache, alloc: TokenToKVPoolAllocator, tokens: list[int]) -> list[int]:
    """Serve a request the way the scheduler does: reuse the matched prefix, cache the rest."""
    m = cache.match_prefix(tokens)
    own = alloc.alloc(len(tokens) - len(m.slot_ids))
    assert own is not None
    slots = m.slot_ids + own
    r = cache.insert(tokens, slots)
    alloc.free(slots[len(m.slot_ids) : r])
    return slots


def path_tokens(node: TreeNode) -> tuple[int, ...]:
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return tuple(t for key in reversed(parts) for t in key)


def tree_contents(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """Map every cached prefix to its slot, checking structural invariants on the way."""
    out: dict[tuple[int, ...], int] = {}
    stack: list[tuple[TreeNode, tuple[int, ...]]] = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for first, child in node.children.items():
            assert child.parent is node
            assert child.key and child.key[0] == first
            assert len(child.key) == len(child.value)
            assert child.lock_ref <= node.lock_ref or node is cache.root
            p = prefix
            for tok, slot in zip(child.key, child.value, strict=True):
                p = p + (tok,)
                out[p] = slot
            stack.append((child, p))
    return out


# ---- unit tests ---------------------------------------------------------------------------------


def test_key_match_len():
    assert _key_match_len([1, 2, 3], [1, 2, 3]) == 3
    assert _key_match_len([1, 2, 3], [1, 2]) == 2
    assert _key_match_len([1, 2], [1, 2, 3]) == 2
    assert _key_match_len([1, 2, 3], [1, 9, 3]) == 1
    assert _key_match_len([], [1]) == 0


def test_page_size_must_be_one():
    alloc = TokenToKVPoolAllocator(4)
    with pytest.raises(ValueError, match="only page_size=1 is supported"):
        RadixCache(alloc, page_size=16)


def test_match_empty_tree_returns_root():
    _, cache = make()
    m = cache.match_prefix([1, 2, 3])
    assert isinstance(m, MatchResult)
    assert m.slot_ids == [] and m.last_node is cache.root
    assert cache.match_prefix([]).last_node is cache.root


def test_insert_return_values():
    _, cache = make()
    assert cache.insert([1, 2, 3], [11, 12, 13]) == 0
    assert cache.insert([1, 2, 3], [21, 22, 23]) == 3  # fully cached: trie keeps its own slots
    assert cache.insert([1, 2, 3, 4, 5], [11, 12, 13, 14, 15]) == 3
    assert cache.insert([1, 2, 7], [11, 12, 17]) == 2
    assert cache.insert([1], [99]) == 1
    assert cache.insert([], []) == 0
    assert cache.total_size() == 6
    assert tree_contents(cache) == {
        (1,): 11, (1, 2): 12, (1, 2, 3): 13, (1, 2, 3, 4): 14, (1, 2, 3, 4, 5): 15, (1, 2, 7): 17
    }  # fmt: skip
    with pytest.raises(ValueError):
        cache.insert([1, 2], [1])


def test_insert_accepts_tuples_and_ranges():
    _, cache = make()
    assert cache.insert((1, 2, 3), range(11, 14)) == 0
    assert cache.match_prefix((1, 2, 3, 4)).slot_ids == [11, 12, 13]
    assert cache.match_prefix(range(1, 3)).slot_ids == [11, 12]


def test_full_match_returns_slots_and_leaf():
    _, cache = make()
    cache.insert([1, 2, 3], [11, 12, 13])
    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert m.slot_ids == [11, 12, 13]
    assert m.last_node.key == [1, 2, 3] and not m.last_node.children


def test_partial_match_splits_node():
    _, cache = make()
    cache.insert([1, 2, 3, 4], [11, 12, 13, 14])
    m = cache.match_prefix([1, 2, 9])
    assert m.slot_ids == [11, 12]
    assert m.last_node.key == [1, 2] and m.last_node.value == [11, 12]
    (child,) = m.last_node.children.values()
    assert child.key == [3, 4] and child.value == [13, 14] and child.parent is m.last_node
    assert cache.root.children[1] is m.last_node
    assert cache.total_size() == 4 and cache.evictable_size() == 4
    # The query ending inside an edge splits too.
    m2 = cache.match_prefix([1, 2, 3])
    assert m2.slot_ids == [11, 12, 13] and path_tokens(m2.last_node) == (1, 2, 3)
    assert tree_contents(cache) == {(1,): 11, (1, 2): 12, (1, 2, 3): 13, (1, 2, 3, 4): 14}


def test_sizes_and_all_slot_ids():
    alloc, cache = make(16)
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 4, 5])
    assert cache.total_size() == 5
    assert cache.evictable_size() == 5 and cache.protected_size() == 0
    assert sorted(cache.all_slot_ids()) == sorted(set(range(1, 17)) - alloc.free_slots())
    assert alloc.available_size() + cache.total_size() == alloc.capacity


def test_lock_protects_from_eviction():
    alloc, cache = make(16)
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [4, 5])
    m = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(m.last_node)
    assert cache.protected_size() == 3 and cache.evictable_size() == 2
    assert cache.evict(100) == 2
    assert cache.match_prefix([1, 2, 3]).slot_ids == m.slot_ids
    assert cache.evict(100) == 0
    cache.dec_lock_ref(m.last_node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 3
    assert cache.evict(1) == 3
    assert cache.total_size() == 0 and alloc.available_size() == 16


def test_lock_counts_nest_and_cover_ancestors():
    _, cache = make()
    cache.insert([1, 2], [11, 12])
    cache.insert([1, 2, 3, 4], [11, 12, 13, 14])
    leaf = cache.match_prefix([1, 2, 3, 4]).last_node
    mid = cache.match_prefix([1, 2]).last_node
    cache.inc_lock_ref(leaf)
    cache.inc_lock_ref(mid)
    assert mid.lock_ref == 2 and leaf.lock_ref == 1
    assert cache.protected_size() == 4
    cache.dec_lock_ref(leaf)
    assert cache.protected_size() == 2 and cache.evictable_size() == 2
    cache.dec_lock_ref(mid)
    assert cache.protected_size() == 0
    with pytest.raises(ValueError):
        cache.dec_lock_ref(mid)
    cache.inc_lock_ref(cache.root)  # root: no-op
    cache.dec_lock_ref(cache.root)
    assert cache.protected_size() == 0


def test_split_of_locked_node_keeps_accounting():
    _, cache = make()
    cache.insert([1, 2, 3, 4], [11, 12, 13, 14])
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(node)
    cache.match_prefix([1, 2, 7])  # splits the locked node
    assert node.key == [3, 4] and node.parent is not None and node.parent.lock_ref == 1
    assert cache.protected_size() == 4
    cache.insert([1, 2, 7], [11, 12, 17])  # new unlocked branch under a locked node
    assert cache.protected_size() == 4 and cache.evictable_size() == 1
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 5


def test_lru_order_and_match_refreshes():
    alloc, cache = make(16)
    a = put(cache, alloc, [1, 1])
    b = put(cache, alloc, [2, 2])
    c = put(cache, alloc, [3, 3])
    cache.match_prefix([1, 1])  # a is now the most recent
    assert cache.evict(2) == 2
    assert cache.match_prefix([2, 2]).slot_ids == []  # b (oldest) went first
    assert set(b) <= alloc.free_slots()
    assert cache.evict(1) == 2  # a whole node is freed
    assert cache.match_prefix([3, 3]).slot_ids == []
    assert cache.match_prefix([1, 1]).slot_ids == a
    assert not set(c) & set(cache.all_slot_ids())


def test_insert_refreshes_recency():
    alloc, cache = make(16)
    put(cache, alloc, [1])
    put(cache, alloc, [2])
    cache.insert([1], [5])  # already cached; refreshes [1]
    cache.evict(1)
    assert cache.match_prefix([1]).slot_ids != []
    assert cache.match_prefix([2]).slot_ids == []


def test_evict_frees_slots_and_parent_becomes_candidate():
    alloc, cache = make(16)
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 4])
    put(cache, alloc, [9])
    assert cache.total_size() == 5 and alloc.available_size() == 11
    # Leaves [3] and [4] are the oldest; then [1, 2] becomes a childless leaf in the same call.
    assert cache.evict(3) == 4
    assert tree_contents(cache) == {(9,): tree_contents(cache)[(9,)]}
    assert alloc.available_size() == 15
    assert cache.evict(0) == 0
    assert cache.evict(100) == 1
    assert cache.evict(100) == 0
    assert alloc.available_size() == 16 and cache.total_size() == 0


def test_evicted_parent_not_taken_if_locked_or_has_children():
    alloc, cache = make(16)
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 4])
    node = cache.match_prefix([1, 2, 4]).last_node
    cache.inc_lock_ref(node)
    assert cache.evict(100) == 1  # only [3]; [1, 2] still has a locked child
    assert tree_contents(cache).keys() == {(1,), (1, 2), (1, 2, 4)}
    cache.dec_lock_ref(node)


def test_reset_frees_everything():
    alloc, cache = make(16)
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [4, 5])
    cache.reset()
    assert cache.total_size() == cache.evictable_size() == cache.protected_size() == 0
    assert cache.all_slot_ids() == [] and not cache.root.children
    assert alloc.available_size() == 16
    assert cache.match_prefix([1, 2, 3]).slot_ids == []
    put(cache, alloc, [1, 2])
    assert cache.total_size() == 2


def test_disabled_cache_is_noop():
    alloc = TokenToKVPoolAllocator(8, debug=True)
    cache = RadixCache(alloc, disable=True)
    slots = alloc.alloc(3)
    assert slots is not None
    assert cache.insert([1, 2, 3], slots) == 3  # takes no ownership
    m = cache.match_prefix([1, 2, 3])
    assert m.slot_ids == [] and m.last_node is cache.root
    cache.inc_lock_ref(m.last_node)
    cache.dec_lock_ref(m.last_node)
    assert cache.evict(10) == 0
    assert cache.total_size() == cache.evictable_size() == cache.protected_size() == 0
    assert cache.all_slot_ids() == []
    alloc.free(slots)  # the caller frees all its slots
    cache.reset()
    assert alloc.available_size() == 8


def test_debug_helpers():
    _, cache = make()
    cache.insert([1, 2], [11, 12])
    assert "[1, 2]" in cache.pretty_print()
    assert "total=2" in repr(cache)


# ---- property test against a reference model ----------------------------------------------------


@dataclass
class Req:
    seq: tuple[int, ...]
    slots: list[int]  # prefix slots from the trie + own slots
    node: TreeNode  # locked last_node of the match
    prefix_len: int


class Harness:
    """Drives the cache like the scheduler and mirrors it with a dict of prefix -> slot."""

    def __init__(self, capacity: int) -> None:
        self.alloc = TokenToKVPoolAllocator(capacity, debug=True)
        self.cache = RadixCache(self.alloc)
        self.model: dict[tuple[int, ...], int] = {}
        self.pending: list[Req] = []

    def longest(self, seq: tuple[int, ...]) -> tuple[int, list[int]]:
        n = 0
        while n < len(seq) and seq[: n + 1] in self.model:
            n += 1
        return n, [self.model[seq[: j + 1]] for j in range(n)]

    def locked_prefixes(self) -> set[tuple[int, ...]]:
        return {r.seq[: j + 1] for r in self.pending for j in range(r.prefix_len)}

    def match(self, seq: tuple[int, ...]) -> MatchResult:
        n, slots = self.longest(seq)
        m = self.cache.match_prefix(seq)
        assert m.slot_ids == slots
        assert path_tokens(m.last_node) == seq[:n]
        return m

    def start(self, seq: tuple[int, ...]) -> None:
        m = self.match(seq)
        self.cache.inc_lock_ref(m.last_node)
        need = len(seq) - len(m.slot_ids)
        short = need - self.alloc.available_size()
        if short > 0:
            self.evict(short)
        own = self.alloc.alloc(need)
        if own is None:
            self.cache.dec_lock_ref(m.last_node)
            return
        self.pending.append(Req(seq, m.slot_ids + own, m.last_node, len(m.slot_ids)))

    def finish(self, i: int) -> None:
        if not self.pending:
            return
        req = self.pending.pop(i % len(self.pending))
        expected, cached = self.longest(req.seq)
        assert expected >= req.prefix_len
        assert cached[: req.prefix_len] == req.slots[: req.prefix_len]
        assert self.cache.insert(req.seq, req.slots) == expected
        self.alloc.free(req.slots[req.prefix_len : expected])
        for j in range(expected, len(req.seq)):
            self.model[req.seq[: j + 1]] = req.slots[j]
        self.cache.dec_lock_ref(req.node)

    def abort(self, i: int) -> None:
        if not self.pending:
            return
        req = self.pending.pop(i % len(self.pending))
        self.alloc.free(req.slots[req.prefix_len :])
        self.cache.dec_lock_ref(req.node)

    def evict(self, k: int) -> None:
        avail, evictable = self.alloc.available_size(), self.cache.evictable_size()
        freed = self.cache.evict(k)
        after = tree_contents(self.cache)
        assert after.items() <= self.model.items()
        removed = self.model.keys() - after.keys()
        assert len(removed) == freed <= evictable
        assert not removed & self.locked_prefixes()
        assert self.alloc.available_size() == avail + freed
        assert freed >= k or self.cache.evictable_size() == 0
        self.model = after

    def check(self) -> None:
        cache, alloc = self.cache, self.alloc
        assert tree_contents(cache) == self.model
        tree_slots = cache.all_slot_ids()
        own = [s for r in self.pending for s in r.slots[r.prefix_len :]]
        free = alloc.free_slots()
        everything = tree_slots + own + list(free)
        assert len(everything) == len(set(everything)) == alloc.capacity  # nothing owned twice
        assert alloc.available_size() + cache.total_size() + len(own) == alloc.capacity
        assert cache.total_size() == len(tree_slots) == len(self.model)
        assert cache.evictable_size() + cache.protected_size() == cache.total_size()
        assert cache.protected_size() == len(self.locked_prefixes())


seqs = st.lists(st.integers(0, 2), max_size=8).map(tuple)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("start"), seqs),
        st.tuples(st.just("start"), seqs),
        st.tuples(st.just("finish"), st.integers(0, 7)),
        st.tuples(st.just("finish"), st.integers(0, 7)),
        st.tuples(st.just("abort"), st.integers(0, 7)),
        st.tuples(st.just("match"), seqs),
        st.tuples(st.just("evict"), st.integers(0, 12)),
    ),
    min_size=20,
    max_size=60,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, capacity=st.integers(8, 40))
def test_random_ops_match_reference_model(ops, capacity):
    h = Harness(capacity)
    for op, arg in ops:
        if op == "start":
            h.start(arg)
        elif op == "finish":
            h.finish(arg)
        elif op == "abort":
            h.abort(arg)
        elif op == "match":
            h.match(arg)
        else:
            h.evict(arg)
        h.check()
    while h.pending:
        h.finish(0)
        h.check()
    assert h.cache.protected_size() == 0
    h.cache.reset()
    assert h.alloc.available_size() == capacity
