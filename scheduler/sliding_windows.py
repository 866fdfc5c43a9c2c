"""Where a sliding-window model may resume in the trie.

The pool keeps every layer's KV of every token (a sliding layer's slots too), but the
disk tier stores a block's sliding-layer KV only where a later prompt can attend it: in
the window before a saved prefix's ends (scheduler/disk_tier.py). A prefix loaded from
disk is thus in the trie with nodes whose slots hold the full-attention layers' KV only
(`TreeNode.windowless`; those layers read them, the sliding layers' masks never reach
them when the match ends far enough after). As SGLang's SWA radix cache does with its
tombstones, a match may end only where the `window` tokens before its end are all
windowed: the first new token's sliding layers attend those.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.radix_cache import MatchResult, RadixCache, TreeNode


def windowless_runs(tree: RadixCache, m: MatchResult) -> list[tuple[int, int]]:
    """The token ranges (start, end) of the windowless nodes on `m`'s path, in order."""
    runs = []
    node, end = m.last_node, len(m.slot_ids)
    while node is not tree.root:
        start = end - len(node.value)
        if node.windowless:
            runs.append((start, end))
        node, end = node.parent, start
    return runs[::-1]


def windowed_end(runs: list[tuple[int, int]], n: int, window: int) -> int:
    """The deepest end <= `n` whose `window` tokens before it are in none of `runs`."""
    end = n
    for start, stop in reversed(runs):
        if stop <= end - window:
            break
        end = start
    return end


def windowed(runs: list[tuple[int, int]], start: int, stop: int) -> bool:
    """Whether tokens start..stop all hold the sliding layers' KV."""
    return not any(a < stop and start < b for a, b in runs)


def take_windowed(root: TreeNode, node: TreeNode, end: int, slot_ids: list[int]) -> int:
    """An insert's windowed KV (`slot_ids`, of every layer) takes the place of the unlocked
    windowless nodes from `node` (ending at `end`) up: each takes the caller's slots of its
    tokens and the caller's list gets the node's old ones there. Returns how many."""
    taken = 0
    while node is not root:
        start = end - len(node.value)
        if node.windowless and not node.lock_ref and node.value != slot_ids[start:end]:
            node.value, slot_ids[start:end] = slot_ids[start:end], node.value
            node.windowless = False
            taken += 1
        end, node = start, node.parent
    return taken
