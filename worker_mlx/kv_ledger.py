"""The KV ledger: where each decoding request's KV is (issue 29's seed).

A request's slot list — every pool slot its KV has, oldest first — is written here and
nowhere else: `open` when its last prefill chunk is done, `add` for each step's slots
it keeps, `drop` at its release. The newest `DecodeBuffer.pending()` of those slots
may still hold nothing in the pool (the deferred flush): the decode buffer has them,
and `where` says which are which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker_mlx.decode_buffer import DecodeBuffer


@dataclass
class KVLocation:
    """Where a request's KV is: `pool_slots` in the pool; `buffered_slots` (the newest
    decode tokens, not yet flushed) only in the decode buffer's row `row`, whose
    `columns` hold all of it."""

    pool_slots: list[int]
    buffered_slots: list[int]
    row: int | None = None
    columns: range | None = None


class KVLedger:
    def __init__(self) -> None:
        self._slots: dict[str, list[int]] = {}

    def open(self, rid: str, slots: list[int]) -> None:
        """`rid` decodes from now on; its KV is at `slots` (prefix and new tokens)."""
        self._slots[rid] = list(slots)

    def add(self, rid: str, slots: list[int]) -> None:
        """A step's tokens of `rid` went (or go, at the next flush) to `slots`."""
        self._slots[rid].extend(slots)

    def slots(self, rid: str) -> list[int]:
        """Every slot of `rid`'s KV, oldest first (the caller must not change it)."""
        return self._slots[rid]

    def drop(self, rid: str) -> None:
        """`rid` was released: the scheduler owns its slots again."""
        self._slots.pop(rid, None)

    def __contains__(self, rid: str) -> bool:
        return rid in self._slots

    def where(self, rid: str, buffer: DecodeBuffer | None) -> KVLocation:
        """Where `rid`'s KV is now, given the runner's decode buffer (None: none)."""
        slots = self._slots[rid]
        place = buffer.columns(rid) if buffer is not None else None
        if place is None:
            return KVLocation(list(slots), [])
        n = buffer.pending()
        return KVLocation(slots[: len(slots) - n], slots[len(slots) - n :], *place)
