"""The disk tier's writer thread: it writes the blocks the MLX thread copied out of the
pool (`DiskTier.save`, worker_mlx/kv_disk.py) into the store, one at a time, so a decode
step never waits for a file write, and every RESCAN_SECONDS runs the tier's rescan (the
LRU order saved, blocks other servers wrote). It gives way to the other threads (a nice
value of its own, on Linux)."""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

from common.kv_store.store import BlockStore
from worker_mlx.kv_disk_report import TierCounts

logger = logging.getLogger(__name__)

# how often the writer looks for blocks other servers wrote and saves the LRU order
RESCAN_SECONDS = 5.0
WRITER_NICE = 10  # the writer thread's nice value, where threads have their own


class BlockWriter:
    """The writer thread and its queue. `rescan`: what it runs every RESCAN_SECONDS."""

    def __init__(self, store: BlockStore, counts: TierCounts, rescan: Callable[[], None]):
        self.store = store
        self.counts = counts
        self._rescan = rescan
        self._scanned = time.monotonic()
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True).start()

    def put(self, key: str, parent: str, tokens: list[int], arrays: dict[str, np.ndarray]) -> None:
        """Queue an entry for the store (its arrays: bytes no one writes any more)."""
        self._queue.put((key, parent, tokens, arrays))

    def _write_loop(self) -> None:
        _yield_cpu()
        while True:
            if time.monotonic() - self._scanned > RESCAN_SECONDS:
                self._scanned = time.monotonic()
                self._rescan()
            try:
                key, parent, tokens, arrays = self._queue.get(timeout=1.0)
            except queue.Empty:
                continue
            started = time.perf_counter()
            try:
                stored = self.store.put(key, parent, tokens, arrays)
            except Exception:  # a store's bug must not end the writer: counted, logged
                logger.exception("kv disk: writing block %s failed", key)
                stored = False
            self._queue.task_done()
            if stored:
                self.counts.wrote(time.perf_counter() - started)
            else:
                self.counts.error("write")

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until the queued writes are on disk (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)


def _yield_cpu() -> None:
    """The calling thread gives way to the others (Linux: a thread has its own nice
    value): the writer's serializing and file writes can wait, the MLX thread's steps
    and the reader's loads should not, and on a 2-core machine they compete."""
    if sys.platform != "linux":
        return  # (macOS: PRIO_PROCESS names processes only; the writer runs as it is)
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    except OSError:
        pass
