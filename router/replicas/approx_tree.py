"""ApproxTree: the router's guess of what one replica's prefix cache holds.

A radix tree (edges are runs of token ids) of the prompts the router sent to that replica,
as SGLang's gateway keeps one per worker for its cache-aware policy. It is approximate: the
replica also caches generated tokens and evicts on its own schedule. Its size is bounded
(`max_tokens`, normally the replica's KV pool size, which bounds the real cache too):
past it, the least recently inserted leaves are cut back first, in whole or in part, down
to PRUNE_TO of the bound so that pruning runs once per many inserts, not on every one.
Only `insert` counts as a use; `match`, called for every replica on every request, does
not change anything. What the replica reports as evicted (`CacheEvicted`) is cut out with
`remove`, so that part of the guess is exact.
"""

from __future__ import annotations

import heapq
import itertools

from common.prefix import common_prefix_len

PRUNE_TO = 0.9  # share of max_tokens left after a prune


class _Node:
    __slots__ = ("edge", "children", "parent", "used")

    def __init__(self, edge: tuple[int, ...], parent: _Node | None, used: int):
        self.edge, self.parent, self.used = edge, parent, used
        self.children: dict[int, _Node] = {}


class ApproxTree:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.size = 0  # tokens held on all edges
        self._clock = itertools.count(1)
        self.root = _Node((), None, 0)

    def match(self, tokens: tuple[int, ...]) -> int:
        """How many leading tokens of `tokens` the tree holds."""
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                return i
            k = common_prefix_len(child.edge, tokens[i : i + len(child.edge)])
            i += k
            if k < len(child.edge):
                return i
            node = child
        return i

    def insert(self, tokens: tuple[int, ...]) -> None:
        """Add `tokens` (a use of its whole path), then prune if over the bound."""
        now = next(self._clock)
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                node.children[tokens[i]] = _Node(tokens[i:], node, now)
                self.size += len(tokens) - i
                break
            k = common_prefix_len(child.edge, tokens[i : i + len(child.edge)])
            if k < len(child.edge):
                child = self._split(child, k)
            child.used = now
            node, i = child, i + k
        if self.size > self.max_tokens:
            self.prune(int(self.max_tokens * PRUNE_TO))

    def _split(self, child: _Node, k: int) -> _Node:
        """Cut `child`'s edge after k tokens; returns the new upper node."""
        upper = _Node(child.edge[:k], child.parent, child.used)
        upper.parent.children[child.edge[0]] = upper
        child.edge, child.parent = child.edge[k:], upper
        upper.children[child.edge[0]] = child
        return upper

    def prune(self, target: int) -> None:
        """Cut least recently used leaves until at most `target` tokens are left."""
        leaves = [(n.used, id(n), n) for n in self._nodes() if not n.children]
        leaves = [leaf for leaf in leaves if leaf[2] is not self.root]
        heapq.heapify(leaves)
        while self.size > target and leaves:
            _, _, leaf = heapq.heappop(leaves)
            excess = self.size - target
            if excess < len(leaf.edge):  # keep the leaf's head: a shorter prefix still matches
                leaf.edge = leaf.edge[: len(leaf.edge) - excess]
                self.size -= excess
                return
            self.size -= len(leaf.edge)
            parent = leaf.parent
            del parent.children[leaf.edge[0]]
            if parent is not self.root and not parent.children:
                heapq.heappush(leaves, (parent.used, id(parent), parent))

    def remove(self, path: tuple[int, ...] | list[int]) -> None:
        """The replica evicted every sequence that starts with `path` (it still holds
        `path[:-1]`): cut the tree there, whether that falls on a node or inside an edge."""
        if not path:
            return
        node, i, end = self.root, 0, len(path) - 1
        while True:
            child = node.children.get(path[i])
            if child is None:
                return  # the tree never had it
            cut = end - i  # where in this edge the path's last token falls
            k = common_prefix_len(child.edge, path[i : i + len(child.edge)])
            if cut == 0:  # the whole child goes
                del node.children[path[i]]
                self.size -= _subtree_size(child)
            elif cut < len(child.edge):
                if k > cut:  # keep the edge's head, drop the rest and all below it
                    self.size -= _subtree_size(child) - cut
                    child.edge, child.children = child.edge[:cut], {}
            elif k == len(child.edge):
                node, i = child, i + k
                continue
            return

    def clear(self) -> None:
        """The replica restarted: its cache is empty."""
        self.root.children.clear()
        self.size = 0

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _subtree_size(node: _Node) -> int:
    size, stack = 0, [node]
    while stack:
        n = stack.pop()
        size += len(n.edge)
        stack.extend(n.children.values())
    return size
