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

from scheduler.radix_cache import MatchResult, RadixCache


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
