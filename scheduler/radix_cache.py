"""Radix tree over token ids whose nodes own the KV slots of their tokens (prefix caching).

Modelled on SGLang's ``mem_cache/radix_cache.py`` with page_size 1. Each edge key is a run of
token ids and the node's ``value`` holds one KV slot id per token. Requests that share a prompt
prefix reuse the slots found by ``match_prefix``; finished requests ``insert`` their sequence so
later requests can reuse it; ``evict`` frees least-recently-used unlocked leaves under memory
pressure. Running requests ``inc_lock_ref`` the node their prefix ends at so it stays put.

For models with recurrent layers a node may also hold a ``snapshot``: a state slot (owned by the
tree like its KV slots) holding the recurrent state after the tokens from the root to the node's
end. Such a model can only resume at a node with a snapshot (``match_snapshot``).

A sliding-window model's node may be ``windowless``: its slots hold the full-attention
layers' KV but not the sliding layers' (blocks the disk tier stored without it), so a match
may end only where the window before it has all its KV (``scheduler/sliding_windows.py``);
an insert of the same tokens with their whole KV takes the place of an unlocked one.

Namespaces (cache salts, ``common/cache_salt.py``): a salted request's tokens hang under a
namespace node, a child of the root whose key is the salt's negative namespace int and which
holds no slot (its ``value`` is empty), so requests of different salts never share a node. All
sizes count slots (``len(value)``), not keys. An empty namespace node is an evictable leaf of no
tokens: eviction removes it like any other, and reports its path (``[namespace]``) so the
router drops the whole namespace from its guess.

Priority (Anthropic ``cache_control`` breakpoints): ``mark_priority`` flags the nodes of a prefix;
eviction takes unflagged leaves first, least recently used first within each class. A flagged
node's ancestors are always flagged (a flag covers a prefix from the root), so every unflagged
node can go before any flagged one does. Flags last as long as their nodes.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count

from common.prefix import common_prefix_len as _key_match_len
from scheduler.memory_pool import TokenToKVPoolAllocator
from scheduler.sliding_windows import take_windowed


class TreeNode:
    """One edge of the tree: ``key`` tokens and their KV ``value`` slots (same length; a
    namespace node has a key of one namespace int and no slot), optionally the state slot
    ``snapshot`` holding the recurrent state at the node's end, and its eviction class
    ``priority`` (1: in a marked prefix, kept ahead of unmarked nodes)."""

    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access", "id", "snapshot",
                 "priority", "windowless")  # fmt: skip

    def __init__(self, node_id: int, key: list[int], value: list[int], parent: TreeNode | None):
        self.id = node_id
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[int, TreeNode] = {}  # keyed by the child's first token id
        self.lock_ref = 0
        self.last_access = 0
        self.snapshot: int | None = None
        self.priority = 0
        self.windowless = False

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock={self.lock_ref})"


@dataclass
class MatchResult:
    slot_ids: list[int]  # KV slots of the longest cached prefix
    last_node: TreeNode  # node ending exactly at the match (root if nothing matched)
    snapshot: int = 0  # match_snapshot only: last_node's state slot (0 at the root)
    kv_len: int = 0  # match_snapshot only: the KV match it was cut back from


class RadixCache:
    """Prefix cache of KV slots. Slots held by the tree are owned by it until evicted/reset."""

    def __init__(
        self,
        allocator: TokenToKVPoolAllocator,
        page_size: int = 1,
        disable: bool = False,
        state_allocator: TokenToKVPoolAllocator | None = None,
        report_evictions: bool = False,
    ) -> None:
        if page_size != 1:
            raise ValueError("only page_size=1 is supported")
        self.allocator = allocator
        self.state_allocator = state_allocator  # where evicted snapshots go (recurrent models)
        self.page_size = page_size
        self.disable = disable
        # With report_evictions, `evict` appends here the path (from the root) to the first
        # token of every subtree it removes, for whoever mirrors this tree (the router).
        self.evicted_paths: list[list[int]] | None = [] if report_evictions else None
        self._ids = count()
        self._clock = count(1)  # logical time: deterministic LRU, unlike wall time
        self._reset_tree()

    def _reset_tree(self) -> None:
        """Empty the tree without freeing anything (used by __init__ and reset)."""
        self.root = TreeNode(next(self._ids), [], [], None)
        self.root.lock_ref = 1  # the root is never evicted
        self.windowless_nodes = 0  # only a sliding-window model's loads from disk make them
        self._evictable = 0
        self._protected = 0

    def reset(self) -> None:
        """Free every slot held by the tree back to the allocator, then empty the tree.

        Locks are dropped too, so only call this when no running request holds a matched prefix.
        """
        self.allocator.free(self.all_slot_ids())
        self._free_snapshots(self.all_snapshots())
        self._reset_tree()

    # ---- sizes --------------------------------------------------------------------------------

    def evictable_size(self) -> int:
        """Tokens in unlocked nodes (reclaimable by ``evict``, possibly after parents' children)."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens in nodes locked by running requests."""
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    # ---- lookup / insert ----------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], namespace: int = 0) -> MatchResult:
        """Find the longest cached prefix of ``token_ids`` (in ``namespace``: 0 for the shared
        cache, else a salt's, see common/cache_salt.py) and refresh its recency.

        A match ending inside an edge splits that edge so ``last_node`` ends exactly at the match
        (the caller can then lock precisely the matched tokens).
        """
        start = None if self.disable else self._namespace(namespace, create=False)
        if start is None:
            return MatchResult([], self.root)
        slots: list[int] = []
        node, _ = self._walk(_as_list(token_ids), slots, start)
        return MatchResult(slots, node)

    def match_snapshot(self, token_ids: Sequence[int], namespace: int = 0) -> MatchResult:
        """The longest cached prefix of ``token_ids`` that ends at a node with a snapshot: the
        deepest such node on the matched path (the root, with nothing, if there is none)."""
        m = self.match_prefix(token_ids, namespace)
        node, n = m.last_node, len(m.slot_ids)
        while node is not self.root and node.snapshot is None:
            n -= len(node.value)
            node = node.parent
        return MatchResult(m.slot_ids[:n], node, node.snapshot or 0, len(m.slot_ids))

    def snapshots_on_path(self, token_ids: Sequence[int], namespace: int = 0) -> dict[int, int]:
        """Every snapshot on the cached path of ``token_ids``: its node's end (a token
        count) -> its state slot, in one walk."""
        m = self.match_prefix(token_ids, namespace)
        node, end, found = m.last_node, len(m.slot_ids), {}
        while node is not self.root:
            if node.snapshot is not None:
                found[end] = node.snapshot
            end -= len(node.value)
            node = node.parent
        return found

    def attach_snapshot(self, token_ids: Sequence[int], slot: int, namespace: int = 0) -> bool:
        """Give the node ending exactly after ``token_ids`` (split there if need be) the state
        slot ``slot``. False, taking nothing, if those tokens are not all cached or that node
        already has a snapshot: the caller still owns ``slot`` then."""
        if self.disable or not token_ids:
            return False
        m = self.match_prefix(token_ids, namespace)
        if len(m.slot_ids) != len(token_ids) or m.last_node.snapshot is not None:
            return False
        m.last_node.snapshot = slot
        return True

    def mark_priority(self, token_ids: Sequence[int], namespace: int = 0) -> int:
        """Flag the cached part of the prefix ``token_ids`` (split where it ends) so eviction
        keeps it ahead of unflagged nodes; returns how many of its tokens were cached."""
        if self.disable or not token_ids:
            return 0
        m = self.match_prefix(token_ids, namespace)
        node = m.last_node
        while node is not self.root and not node.priority:
            node.priority = 1
            node = node.parent
        return len(m.slot_ids)

    def _namespace(self, namespace: int, create: bool) -> TreeNode | None:
        """The node a namespace's sequences hang under: the root for 0, else the root's child
        keyed by the namespace int, made if ``create`` (None if absent and not made)."""
        if not namespace:
            return self.root
        node = self.root.children.get(namespace)
        if node is None and create:
            node = TreeNode(next(self._ids), [namespace], [], self.root)
            self.root.children[namespace] = node
        return node

    def insert(
        self, token_ids: Sequence[int], slot_ids: Sequence[int], namespace: int = 0,
        windowless: bool = False,
    ) -> int:  # fmt: skip
        """Cache ``token_ids`` with their KV ``slot_ids``; return how many were already cached.

        The tree takes ownership of ``slot_ids[r:]`` where r is the return value. The caller keeps
        ownership of ``slot_ids[:r]`` and must free those it did not get from the tree. With
        ``disable=True`` nothing is taken and r == len(token_ids): the caller frees all its slots.
        ``windowless``: the new slots lack the sliding layers' KV (the new node is marked);
        else an unlocked windowless node on the way takes the caller's slots, whose list
        (then a ``list``) gets the node's old ones in their place, the caller's to free.
        """
        if len(token_ids) != len(slot_ids):
            raise ValueError(f"{len(token_ids)} tokens but {len(slot_ids)} slots")
        if self.disable:
            return len(token_ids)
        tokens = _as_list(token_ids)
        node, matched = self._walk(tokens, None, self._namespace(namespace, create=True))
        if not windowless and self.windowless_nodes and isinstance(slot_ids, list):
            self.windowless_nodes -= take_windowed(self.root, node, matched, slot_ids)
        if matched < len(tokens):
            leaf = TreeNode(next(self._ids), tokens[matched:], list(slot_ids[matched:]), node)
            leaf.last_access = node.last_access
            leaf.windowless = windowless
            self.windowless_nodes += windowless
            node.children[tokens[matched]] = leaf
            self._evictable += len(leaf.value)
        return matched

    def _walk(
        self, tokens: list[int], slots: list[int] | None, start: TreeNode
    ) -> tuple[TreeNode, int]:
        """Descend from ``start`` (the root or a namespace node) along ``tokens`` splitting a
        partially matched edge; refresh recency.

        Returns the deepest node reached and the number of tokens matched; appends the matched
        slots to ``slots`` if given.
        """
        now = next(self._clock)
        self.root.last_access = start.last_access = now
        node = start
        i, n = 0, len(tokens)
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                break
            key = child.key
            seg = tokens[i : i + len(key)]
            k = len(key) if seg == key else _key_match_len(key, seg)
            if k < len(key):
                child = self._split(child, k)
            child.last_access = now
            if slots is not None:
                slots.extend(child.value)
            node = child
            i += k
            if k < len(key):
                break
        return node, i

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Split ``child`` after its first ``k`` tokens; return the new upper node.

        The upper node inherits the lock count so lock/unlock paths stay consistent, and sizes do
        not change (same tokens, same locks). A snapshot stays on the lower part, whose end is
        unchanged; the upper part has none.
        """
        parent = child.parent
        assert parent is not None and 0 < k < len(child.key)
        upper = TreeNode(next(self._ids), child.key[:k], child.value[:k], parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.priority = child.priority
        upper.windowless = child.windowless
        self.windowless_nodes += child.windowless
        child.key = child.key[k:]
        child.value = child.value[k:]
        child.parent = upper
        upper.children[child.key[0]] = child
        parent.children[upper.key[0]] = upper
        return upper

    # ---- locking ------------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction (one count per caller)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.value)
                self._protected += len(node.value)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one ``inc_lock_ref(node)``; raises if ``node`` is not locked."""
        # Ancestors always hold at least the node's count, so checking the node itself suffices.
        if node is not self.root and node.lock_ref <= 0:
            raise ValueError(f"dec_lock_ref on unlocked node {node!r}")
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.value)
                self._protected -= len(node.value)
            assert node.parent is not None
            node = node.parent

    # ---- eviction -----------------------------------------------------------------------------

    def evict(self, num_tokens: int, num_snapshots: int = 0) -> int:
        """Free at least ``num_tokens`` tokens and ``num_snapshots`` snapshots (if possible)
        from unlocked leaves: unflagged ones first (see ``mark_priority``), least recently used
        first within each class.

        Slots go back to their allocators. A parent left childless and unlocked becomes a
        candidate in the same call. Returns the number of tokens freed. Cost is O(nodes) to
        collect leaves plus O(evicted log leaves).
        """
        if self.disable or (num_tokens <= 0 and num_snapshots <= 0):
            return 0
        heap = [(n.priority, n.last_access, n.id, n) for n in self._evictable_leaves()]
        heapq.heapify(heap)
        freed = snapshots = 0
        removed: dict[int, tuple[TreeNode, int]] = {}  # node id -> (its parent, first token)
        while (freed < num_tokens or snapshots < num_snapshots) and heap:
            node = heapq.heappop(heap)[-1]
            parent = node.parent
            assert parent is not None
            removed[node.id] = (parent, node.key[0])
            self.allocator.free(node.value)
            if node.snapshot is not None:
                self._free_snapshots([node.snapshot])
                snapshots += 1
            self.windowless_nodes -= node.windowless
            freed += len(node.value)
            self._evictable -= len(node.value)
            del parent.children[node.key[0]]
            node.parent = None
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.priority, parent.last_access, parent.id, parent))
        if self.evicted_paths is not None:
            self._report(removed)
        return freed

    def _report(self, removed: dict[int, tuple[TreeNode, int]]) -> None:
        """The path to each removed subtree's top, a node whose parent stayed (a node
        removed with its parent is covered by the parent's path)."""
        for parent, first in removed.values():
            if parent.id not in removed:
                self.evicted_paths.append(self.path_to(parent) + [first])

    def path_to(self, node: TreeNode) -> list[int]:
        """The tokens from the root to the end of `node` (behind its namespace int, if any)."""
        keys = []
        while node is not self.root:
            keys.append(node.key)
            node = node.parent
        return [t for key in reversed(keys) for t in key]

    def _evictable_leaves(self) -> list[TreeNode]:
        leaves: list[TreeNode] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.lock_ref == 0:
                leaves.append(node)
        return leaves

    # ---- debugging / invariants ---------------------------------------------------------------

    def all_slot_ids(self) -> list[int]:
        """Every slot owned by the tree (for invariant checks and ``reset``)."""
        out: list[int] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            out.extend(node.value)
            stack.extend(node.children.values())
        return out

    def all_snapshots(self) -> list[int]:
        """Every state slot held by the tree as a snapshot."""
        out: list[int] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.snapshot is not None:
                out.append(node.snapshot)
            stack.extend(node.children.values())
        return out

    def _free_snapshots(self, slots: list[int]) -> None:
        if slots:
            assert self.state_allocator is not None, "a snapshot without a state allocator"
            self.state_allocator.free(slots)

    def pretty_print(self) -> str:
        """Indented dump of the tree: one line per node with its tokens and lock count."""
        lines: list[str] = []
        stack = [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            snap = "" if node.snapshot is None else f" snapshot={node.snapshot}"
            snap += " priority" if node.priority else ""
            lines.append(
                f"{'  ' * depth}{node.key} lock={node.lock_ref} t={node.last_access}{snap}"
            )
            stack.extend((c, depth + 1) for c in node.children.values())
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"RadixCache(total={self.total_size()}, evictable={self._evictable}, "
            f"protected={self._protected}, disable={self.disable})"
        )


def _as_list(token_ids: Sequence[int]) -> list[int]:
    # Keys are lists, so slice comparisons need a list (a tuple never equals a list).
    return token_ids if isinstance(token_ids, list) else list(token_ids)
