"""KVCacheManager: the request lifecycle over the trie, the slot allocator and ReqToTokenPool.

Ownership rule: the trie holds a request's first `cache_len` tokens, locked through
`req.last_node`; the request owns its slots after those, plus `dup_slots` (its own copies
of tokens the trie got from someone else first). Every slot is therefore
free, in the trie (evictable or locked), or owned by exactly one running request —
`check_invariants` verifies that.

Models with recurrent layers (`num_state_slots > 0`) also have state slots, whose data the
worker holds: each running request owns one working state (`req.state_slot`), a trie node
may own a snapshot (the state at its end), and a snapshot the worker was told to take but
whose tokens are not in the trie yet is owned by its request (`req.pending_snapshots`).
Such a model can only resume from a snapshot, so its matches end at the deepest one.
A sliding-window model with the disk tier resumes only where its sliding layers' window
holds KV (`window`, scheduler/sliding_windows.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.messages import ExtendReq
from scheduler.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from scheduler.radix_cache import MatchResult, RadixCache
from scheduler.request import Req
from scheduler.sliding_windows import windowed_end, windowless_runs

EVICT_FRACTION = 1024  # evict at least capacity / 1024 tokens when short


@dataclass
class Admission:
    """What a request's next extend piece reads and writes (the ExtendReq's slot fields)."""

    prefix_slot_ids: list[int]
    out_cache_loc: list[int]
    prefix_state: int = 0  # state slot holding the state after exactly the prefix
    snapshots: list[list[int]] = field(default_factory=list)  # [n new tokens, state slot]


class KVCacheManager:
    def __init__(
        self,
        num_slots: int,
        max_requests: int,
        disable_radix_cache: bool,
        debug=False,
        num_state_slots: int = 0,
    ):
        self.allocator = TokenToKVPoolAllocator(num_slots, debug=debug)
        # the same free list, over state slots 1..num_state_slots (None: no recurrent layers)
        self.states = TokenToKVPoolAllocator(num_state_slots, debug) if num_state_slots else None
        self.tree = RadixCache(
            self.allocator,
            disable=disable_radix_cache,
            state_allocator=self.states,
            report_evictions=True,
        )
        self.req_to_token = ReqToTokenPool(max_requests)
        self.evicted_tokens = 0
        # with the disk tier on a recurrent model, its block size: each prompt also
        # snapshots its state at its last block end, for the block to carry (disk_tier.py)
        self.block_tokens = 0
        # with the disk tier on a sliding-window model, its largest window: a match ends
        # only where the window before it holds the sliding layers' KV
        self.window = 0

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def budget(self) -> int:
        """Slots obtainable right now: free ones plus what eviction could reclaim."""
        return self.allocator.available_size() + self.tree.evictable_size()

    def token_usage(self) -> float:
        """Share of the pool held by running requests (locked or owned), not by idle cache."""
        return 1.0 - self.budget() / self.capacity

    def _match(self, req: Req) -> MatchResult:
        """The usable cached prefix of `req`'s fill tokens in its namespace (its cache salt's),
        leaving at least one token to compute, and never ending inside an image's run: a
        run's KV is reused whole or not at all, so another image is reused only if its
        pad values agree at every position of the run (common/image_keys.py)."""
        fill = req.fill_ids
        head = fill[: len(fill) - 1]
        m = self.match_head(head, req.namespace)
        cut = whole_runs(req.images, len(m.slot_ids))
        return m if cut == len(m.slot_ids) else self.match_head(head[:cut], req.namespace)

    def match_head(self, head: list[int], namespace: int) -> MatchResult:
        """The longest prefix of `head` this model can resume after: to a snapshot
        (recurrent layers), where the sliding layers' window holds KV (`window`)."""
        if self.window and self.tree.windowless_nodes:
            m = self.tree.match_prefix(head, namespace)
            end = windowed_end(windowless_runs(self.tree, m), len(m.slot_ids), self.window)
            if end == len(m.slot_ids) and not self.states:
                return m
            head = head[:end]
        if self.states:
            return self.tree.match_snapshot(head, namespace)
        return self.tree.match_prefix(head, namespace)

    def match(self, req: Req) -> list[int]:
        """Prefix slots for `req`'s fill tokens, leaving at least one token to compute."""
        return self._match(req).slot_ids

    def alloc(self, n: int) -> list[int] | None:
        """n fresh slots, evicting least-recently-used cache when short."""
        short = n - self.allocator.available_size()
        if short > 0:
            # Each eviction walks the trie, so free a slice of the pool at once rather than
            # exactly what this step needs: a full pool would otherwise walk it every step.
            batch = max(short, self.capacity // EVICT_FRACTION)
            self.evicted_tokens += self.tree.evict(batch)
        return self.allocator.alloc(n)

    def alloc_state(self) -> int:
        """A fresh state slot, evicting least-recently-used cache leaves (and with them their
        snapshots) when none is free; 0 when none can be had."""
        if self.states.available_size() == 0:
            self.evicted_tokens += self.tree.evict(0, num_snapshots=1)
        got = self.states.alloc(1)
        return got[0] if got else 0

    def admit(self, req: Req, max_new: int) -> Admission | None:
        """Lock `req`'s cached prefix and allocate slots for its next tokens, at most
        `max_new` of them; a first admission also takes the request's working state slot.

        Returns the Admission, or None (nothing changed) if out of slots.
        """
        if req.rid not in self.req_to_token:
            return self._admit_first(req, max_new)
        prefix = list(self.req_to_token.get(req.rid))  # a chunk continuation
        locs = self.alloc(min(len(req.fill_ids) - len(prefix), max_new))
        if locs is None:
            return None
        self.req_to_token.append(req.rid, locs)
        req.num_computed += len(locs)
        return self._with_snapshot(req, Admission(prefix, locs, req.state_slot))

    def _admit_first(self, req: Req, max_new: int) -> Admission | None:
        fill = req.fill_ids
        m = self._match(req)
        self.tree.inc_lock_ref(m.last_node)
        # Every chunk must fit once the prefix is locked (the admission budget counted it as
        # evictable): a half-prefilled request cannot be retracted to make room.
        state = self.alloc_state() if self.states else 0
        locs = None
        if self.budget() >= len(fill) - len(m.slot_ids) and (state or not self.states):
            locs = self.alloc(min(len(fill) - len(m.slot_ids), max_new))
        if locs is None:
            self.tree.dec_lock_ref(m.last_node)
            if state:
                self.states.free([state])
            return None
        req.last_node, req.cache_len = m.last_node, len(m.slot_ids)
        req.num_computed = len(m.slot_ids) + len(locs)
        req.state_slot = state
        if m.kv_len > len(m.slot_ids):  # the cached KV went further: where this prompt
            req.branch_points = [m.kv_len]  # branches off, for the next one that does
        self.req_to_token.alloc(req.rid, m.slot_ids + locs)
        return self._with_snapshot(req, Admission(m.slot_ids, locs, m.snapshot))

    def _with_snapshot(self, req: Req, adm: Admission) -> Admission:
        """Add the piece's snapshots: the state after a chunk that is not the last, or, in
        the last one, after all but the last token (where the same prompt sent again, or a
        resumed request, matches), and at the branch points the piece reaches. Each is
        skipped when no state slot can be had."""
        if self.states is None or self.tree.disable:
            return adm
        start, end, fill_len = len(adm.prefix_slot_ids), req.num_computed, len(req.fill_ids)
        points = {end if end < fill_len else fill_len - 1}
        if self.block_tokens and (fill_len - 1) // self.block_tokens:
            block_end = (fill_len - 1) // self.block_tokens * self.block_tokens
            if block_end <= end:
                points.add(block_end)
        points.update(p for p in req.branch_points if p <= end)
        req.branch_points = [p for p in req.branch_points if p > end]
        for at in sorted(p for p in points if p > start):
            self._snapshot(req, adm.snapshots, start, at)
        return adm

    def _snapshot(self, req: Req, snapshots: list[list[int]], start: int, at: int) -> None:
        """Ask for the state after `at` tokens in the piece that starts at `start`."""
        slot = self.alloc_state()
        if slot:
            snapshots.append([at - start, slot])
            req.pending_snapshots.append((at, slot))

    def snapshot_for_twin(self, req: Req, ext: ExtendReq, at: int) -> None:
        """A waiting prompt shares `req`'s first `at` tokens, which `req` computes now or in
        a later chunk: snapshot the state there, so that prompt can resume from it."""
        if self.states is None or self.tree.disable:
            return
        if at in req.branch_points or any(a == at for a, _ in req.pending_snapshots):
            return
        start = len(ext.prefix_slot_ids)
        if at > start + len(ext.input_ids):
            req.branch_points.append(at)
        elif at > start:
            self._snapshot(req, ext.snapshots, start, at)

    def cache_unfinished(self, req: Req) -> None:
        """Insert `req`'s computed tokens into the trie so waiting requests can share them,
        with the snapshots the worker has just taken.

        Where the trie already held some of these tokens (computed meanwhile by another
        request), the request keeps its own duplicate slots until it is released: the worker
        still reads them, so handing them to someone else now would corrupt this request.
        """
        if self.tree.disable:
            return
        slots = self.req_to_token.get(req.rid)
        tokens = req.fill_ids[: req.num_computed]
        given = slots[: req.num_computed]  # (an insert may swap windowless slots into it)
        done = self.tree.insert(tokens, given, req.namespace)
        req.dup_slots += given[req.cache_len : done]
        m = self.tree.match_prefix(tokens, req.namespace)
        self.tree.inc_lock_ref(m.last_node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node, req.cache_len = m.last_node, len(m.slot_ids)
        for at, slot in req.pending_snapshots:
            self.attach_snapshot(tokens[:at], slot, req.namespace)
        req.pending_snapshots = []

    def attach_snapshot(self, tokens: list[int], slot: int, namespace: int) -> bool:
        """Hand `slot` to the trie node ending after `tokens`, or free it (False) if that
        node already has a snapshot (or is not there)."""
        if self.tree.attach_snapshot(tokens, slot, namespace):
            return True
        self.states.free([slot])
        return False

    def append_decode_slot(self, req: Req, slot: int) -> None:
        self.req_to_token.append(req.rid, [slot])
        req.num_computed += 1

    def keep_draft_slots(self, req: Req, kept: list[int], rejected: list[int]) -> None:
        """After a verify step: the slots of the drafts `req` kept hold its KV now, the
        rest go back to the allocator (the trie only ever holds accepted tokens)."""
        self.req_to_token.append(req.rid, kept)
        req.num_computed += len(kept)
        self.allocator.free(rejected)

    def release(self, req: Req, keep: bool) -> int:
        """Return `req`'s slots: into the trie when `keep` (finished, retracted), else freed.

        Returns the state slot the worker must copy the request's final state into
        (`ReleaseReq.snapshot`; 0 for none), already the snapshot of its last trie node.
        The caller must queue the matching worker release (flush or drop) in the same step.
        """
        snapshot = self.alloc_state() if keep and self.states and not self.tree.disable else 0
        slots = self.req_to_token.free(req.rid)
        self.allocator.free(req.dup_slots)
        req.dup_slots = []
        if keep:
            tokens = req.fill_ids[: len(slots)]
            done = self.tree.insert(tokens, slots, req.namespace)
            self.allocator.free(slots[req.cache_len : done])
            if snapshot and not self.attach_snapshot(tokens, snapshot, req.namespace):
                snapshot = 0
            # the prompt's cache_control prefix (Anthropic's breakpoints) outlasts the rest
            self.tree.mark_priority(tokens[: req.priority_len], req.namespace)
        else:
            self.allocator.free(slots[req.cache_len :])
        self.tree.dec_lock_ref(req.last_node)
        if self.states is not None:
            self.states.free([req.state_slot] + [s for _, s in req.pending_snapshots])
        req.last_node, req.cache_len, req.num_computed = None, 0, 0
        req.state_slot, req.pending_snapshots, req.branch_points = 0, [], []
        return snapshot

    def check_invariants(
        self, holders: list[Req], loading: list[int] = (), loading_states: list[int] = ()
    ) -> None:
        """free + trie + owned by `holders` (+ `loading`, `loading_states`: slots the disk
        tier is reading blocks and states into) == capacity, and no slot has two owners;
        the same for state slots."""
        own = [
            s for r in holders for s in self.req_to_token.get(r.rid)[r.cache_len :] + r.dup_slots
        ]
        trie = self.tree.all_slot_ids()
        _check_owners(
            "KV", self.capacity, free=self.allocator.free_slots(), trie=trie, running=own,
            loading=list(loading),
        )  # fmt: skip
        if len(self.req_to_token) != len(holders):
            raise AssertionError("ReqToTokenPool and the running requests disagree")
        if self.states is not None:
            _check_owners(
                "state",
                self.states.capacity,
                free=self.states.free_slots(),
                snapshots=self.tree.all_snapshots(),
                working=[r.state_slot for r in holders],
                pending=[s for r in holders for _, s in r.pending_snapshots],
                loading=list(loading_states),
            )


def _check_owners(what: str, capacity: int, **owners) -> None:
    everything = [s for group in owners.values() for s in group]
    if len(everything) != len(set(everything)):
        raise AssertionError(f"a {what} slot has two owners")
    if set(everything) != set(range(1, capacity + 1)):
        counts = " + ".join(f"{name} {len(group)}" for name, group in owners.items())
        raise AssertionError(f"{what} slots lost: {counts} != capacity {capacity}")


def whole_runs(images, n: int) -> int:
    """`n` cached tokens cut back to the start of the image run they end inside, if any."""
    inside = [im.start for im in images if im.start < n < im.start + im.length]
    return min(inside, default=n)
