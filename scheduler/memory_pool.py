"""Bookkeeping for KV-cache slots: which slots are free, and which slots each request uses.

The scheduler never touches KV tensors. It only hands out integer slot ids that the worker uses
to index its KV pool (which has ``size + 1`` rows: row 0 is the padding slot).
"""

from __future__ import annotations

from collections.abc import Iterable


class TokenToKVPoolAllocator:
    """Free list of KV slot ids ``1..size``; slot 0 is reserved for padding and never handed out.

    The free list is a plain list used as a stack so ``alloc``/``free`` cost O(slots touched):
    the scheduler calls them for every running request on every decode step.
    """

    def __init__(self, size: int, debug: bool = False) -> None:
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        self._size = size
        self._debug = debug
        # Reversed so the lowest ids are handed out first (nicer to read in logs and tests).
        self._free: list[int] = list(range(size, 0, -1))
        # Only kept in debug mode: O(1) membership for double-free detection.
        self._free_set: set[int] | None = set(self._free) if debug else None

    @property
    def capacity(self) -> int:
        return self._size

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """Return ``n`` free slot ids, or None (allocating nothing) if fewer are available."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n == 0:
            return []
        if n > len(self._free):
            return None
        out = self._free[-n:]
        del self._free[-n:]
        out.reverse()
        if self._free_set is not None:
            self._free_set.difference_update(out)
        return out

    def free(self, slots: Iterable[int]) -> None:
        """Return slots to the free list. In debug mode, bad or double frees raise ValueError."""
        if self._free_set is None:
            self._free.extend(slots)
            return
        slots = list(slots)
        for s in slots:
            if not 1 <= s <= self._size:
                raise ValueError(f"slot {s} out of range 1..{self._size}")
            if s in self._free_set:
                raise ValueError(f"double free of slot {s}")
            self._free_set.add(s)
        self._free.extend(slots)

    def free_slots(self) -> set[int]:
        """Snapshot of the free slot ids (for invariant checks, O(size))."""
        return set(self._free)


class ReqToTokenPool:
    """Maps each running request id to the KV slot ids of its tokens (cached prefix + own)."""

    def __init__(self, max_requests: int) -> None:
        self._max = max_requests
        self._slots: dict[str, list[int]] = {}

    def __contains__(self, rid: object) -> bool:
        return rid in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def available_size(self) -> int:
        return self._max - len(self._slots)

    def alloc(self, rid: str, slot_ids: Iterable[int]) -> None:
        if rid in self._slots:
            raise ValueError(f"request {rid!r} already has slots")
        if len(self._slots) >= self._max:
            raise RuntimeError(f"ReqToTokenPool full ({self._max} requests)")
        self._slots[rid] = list(slot_ids)

    def get(self, rid: str) -> list[int]:
        """The request's slot list itself (not a copy; do not mutate it directly)."""
        return self._slots[rid]

    def append(self, rid: str, slot_ids: Iterable[int]) -> None:
        self._slots[rid].extend(slot_ids)

    def free(self, rid: str) -> list[int]:
        """Forget the request and return its slot list (the caller decides which slots to free)."""
        return self._slots.pop(rid)
