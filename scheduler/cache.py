"""KVCacheManager: the request lifecycle over the trie, the slot allocator and ReqToTokenPool.

Ownership rule: the trie holds a request's first `cache_len` tokens, locked through
`req.last_node`; the request owns its slots after those, plus `dup_slots` (its own copies
of tokens the trie got from someone else first). Every slot is therefore
free, in the trie (evictable or locked), or owned by exactly one running request —
`check_invariants` verifies that.
"""

from __future__ import annotations

from scheduler.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from scheduler.radix_cache import RadixCache
from scheduler.request import Req

EVICT_FRACTION = 1024  # evict at least capacity / 1024 tokens when short


class KVCacheManager:
    def __init__(self, num_slots: int, max_requests: int, disable_radix_cache: bool, debug=False):
        self.allocator = TokenToKVPoolAllocator(num_slots, debug=debug)
        self.tree = RadixCache(self.allocator, disable=disable_radix_cache)
        self.req_to_token = ReqToTokenPool(max_requests)
        self.evicted_tokens = 0

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def budget(self) -> int:
        """Slots obtainable right now: free ones plus what eviction could reclaim."""
        return self.allocator.available_size() + self.tree.evictable_size()

    def token_usage(self) -> float:
        """Share of the pool held by running requests (locked or owned), not by idle cache."""
        return 1.0 - self.budget() / self.capacity

    def match(self, req: Req) -> list[int]:
        """Prefix slots for `req`'s fill tokens, leaving at least one token to compute."""
        fill = req.fill_ids
        return self.tree.match_prefix(fill[: len(fill) - 1]).slot_ids

    def alloc(self, n: int) -> list[int] | None:
        """n fresh slots, evicting least-recently-used cache when short."""
        short = n - self.allocator.available_size()
        if short > 0:
            # Each eviction walks the trie, so free a slice of the pool at once rather than
            # exactly what this step needs: a full pool would otherwise walk it every step.
            batch = max(short, self.capacity // EVICT_FRACTION)
            self.evicted_tokens += self.tree.evict(batch)
        return self.allocator.alloc(n)

    def admit(self, req: Req, new_len: int) -> tuple[list[int], list[int]] | None:
        """Lock `req`'s cached prefix and allocate slots for its next `new_len` tokens.

        Returns (prefix_slot_ids, out_cache_loc), or None (nothing changed) if out of slots.
        """
        fill = req.fill_ids
        if req.rid in self.req_to_token:  # a chunk continuation: prefix is what we computed
            prefix = list(self.req_to_token.get(req.rid))
        else:
            m = self.tree.match_prefix(fill[: len(fill) - 1])
            self.tree.inc_lock_ref(m.last_node)
            # Every chunk must fit once the prefix is locked (the admission budget counted it
            # as evictable): a half-prefilled request cannot be retracted to make room.
            if self.budget() < len(fill) - len(m.slot_ids):
                self.tree.dec_lock_ref(m.last_node)
                return None
            locs = self.alloc(new_len)
            if locs is None:
                self.tree.dec_lock_ref(m.last_node)
                return None
            req.last_node, req.cache_len = m.last_node, len(m.slot_ids)
            req.num_computed = len(m.slot_ids) + new_len
            self.req_to_token.alloc(req.rid, m.slot_ids + locs)
            return m.slot_ids, locs
        locs = self.alloc(new_len)
        if locs is None:
            return None
        self.req_to_token.append(req.rid, locs)
        req.num_computed += new_len
        return prefix, locs

    def cache_unfinished(self, req: Req) -> None:
        """Insert `req`'s computed tokens into the trie so waiting requests can share them.

        Where the trie already held some of these tokens (computed meanwhile by another
        request), the request keeps its own duplicate slots until it is released: the worker
        still reads them, so handing them to someone else now would corrupt this request.
        """
        if self.tree.disable:
            return
        slots = self.req_to_token.get(req.rid)
        tokens = req.fill_ids[: req.num_computed]
        done = self.tree.insert(tokens, slots[: req.num_computed])
        req.dup_slots += slots[req.cache_len : done]
        m = self.tree.match_prefix(tokens)
        self.tree.inc_lock_ref(m.last_node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node, req.cache_len = m.last_node, len(m.slot_ids)

    def append_decode_slot(self, req: Req, slot: int) -> None:
        self.req_to_token.append(req.rid, [slot])
        req.num_computed += 1

    def release(self, req: Req, keep: bool) -> None:
        """Return `req`'s slots: into the trie when `keep` (finished, retracted), else freed.

        The caller must have queued the matching worker release (flush or drop) first.
        """
        slots = self.req_to_token.free(req.rid)
        self.allocator.free(req.dup_slots)
        req.dup_slots = []
        if keep:
            done = self.tree.insert(req.fill_ids[: len(slots)], slots)
            self.allocator.free(slots[req.cache_len : done])
        else:
            self.allocator.free(slots[req.cache_len :])
        self.tree.dec_lock_ref(req.last_node)
        req.last_node, req.cache_len, req.num_computed = None, 0, 0

    def check_invariants(self, holders: list[Req]) -> None:
        """free + trie + owned by `holders` == capacity, and no slot has two owners."""
        own = [
            s for r in holders for s in self.req_to_token.get(r.rid)[r.cache_len :] + r.dup_slots
        ]
        free = self.allocator.free_slots()
        trie = self.tree.all_slot_ids()
        everything = list(free) + trie + own
        if len(everything) != len(set(everything)):
            raise AssertionError("a KV slot has two owners")
        if set(everything) != set(range(1, self.capacity + 1)):
            raise AssertionError(
                f"slots lost: free {len(free)} + trie {len(trie)} + running {len(own)}"
                f" != capacity {self.capacity}"
            )
        if len(self.req_to_token) != len(holders):
            raise AssertionError("ReqToTokenPool and the running requests disagree")
