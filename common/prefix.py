"""The common prefix of two token runs, shared by the scheduler's trie and the router's."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # fast path: C-level comparison
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
