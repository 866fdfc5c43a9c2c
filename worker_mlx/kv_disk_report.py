"""The disk tier's report: what its threads count between two reports (the writer's
writes, the reader's reads, errors by reason, blocks other servers wrote) and the
`DiskReport` of what changed, which rides on the worker's replies and the reader's
answers (worker_mlx/kv_disk.py)."""

from __future__ import annotations

import threading
from collections import Counter

from common.kv_store.store import BlockStore
from common.messages import DiskReport


class TierCounts:
    """The tier's counts since the last report: any thread counts (under `lock`)."""

    def __init__(self, store: BlockStore):
        self.store = store
        self.lock = threading.Lock()
        self._report_lock = threading.Lock()
        self.errors: Counter[str] = Counter()
        self.reads: list[float] = []
        self.writes: list[float] = []
        self.added: list[str] = []
        self._last_state = None

    def error(self, reason: str) -> None:
        with self.lock:
            self.errors[reason] += 1

    def read(self, seconds: float) -> None:
        with self.lock:
            self.reads.append(seconds)

    def wrote(self, seconds: float) -> None:
        with self.lock:
            self.writes.append(seconds)

    def found(self, added: list[str]) -> None:
        """Blocks other servers wrote (the store's rescan)."""
        with self.lock:
            self.added += added

    def report(self) -> DiskReport | None:
        """What changed since the last report (None: nothing). Both the MLX thread and
        the reader (its answers) report: one at a time."""
        with self._report_lock:
            return self._report()

    def _report(self) -> DiskReport | None:
        usage = self.store.usage()
        dropped = self.store.take_dropped()
        with self.lock:
            news = DiskReport(
                usage[0], usage[1], dict(self.errors), self.reads, self.writes, dropped,
                self.added, self.store.writable,
            )  # fmt: skip
            self.errors, self.reads, self.writes, self.added = Counter(), [], [], []
        state = (usage, news.writable)
        if state == self._last_state and not (
            news.errors or news.read_seconds or news.write_seconds or dropped or news.added
        ):
            return None
        self._last_state = state
        return news
