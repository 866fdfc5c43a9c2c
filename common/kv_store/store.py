"""The storage interface of the disk tier: what the worker asks of a store, so that a
shared store (an object store, a peer's cache) can stand in for the file backend without
the scheduler or the worker's pool code changing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


class BlockError(Exception):
    """A block that cannot be served; `reason` labels radix_mlx_kv_disk_errors_total:
    missing, truncated, checksum, foreign (another model's or layout's), write."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class StoredBlock:
    key: str
    parent: str
    tokens: list[int]
    arrays: dict[str, np.ndarray]  # name -> raw bytes as uint8, as put


class BlockStore(Protocol):
    writable: bool

    def keys(self) -> list[str]:
        """Every block held (at start-up: what the scheduler may match)."""

    def usage(self) -> tuple[int, int]:
        """(bytes, blocks) held."""

    def take_dropped(self) -> list[str]:
        """Keys evicted or refused since the last call (the scheduler forgets them)."""

    def put(self, key: str, parent: str, tokens: list[int], arrays: dict[str, np.ndarray]) -> bool:
        """Store a block; False when it was not stored (the store does not write)."""

    def touch(self, keys: list[str]) -> None:
        """Mark blocks used now (the LRU), without reading them."""

    def get(self, key: str) -> StoredBlock:
        """The block, verified; raises BlockError."""

    def rescan(self) -> list[str]:
        """Blocks others sharing the store added since the last look (their keys)."""

    def save_index(self) -> None:
        """Persist whatever speeds up the next start (may do nothing)."""
