"""The disk tier on the worker's side: blocks copied out of the pool and written by a
writer thread, blocks read back into fresh pool slots, and the tier's report.

The copy out of the pool happens on the MLX thread when the ReleaseBatch that names the
blocks arrives (after its flush, before any later descriptor can reuse the slots): a
gather evaluated at once, handed to the writer thread as bytes. So a decode step never
waits for a file write, only for that copy. A load (LoadBatch) is read and checked by a
reader thread while the MLX thread goes on with its steps; between two steps the MLX
thread writes what was read into the pool (`install_ready`) and answers BlocksLoaded.

Which models use the tier is decided here (`unsupported`): the pool's KV alone must be
the whole of a prefix's cache, and the pool must be one process's.
"""

from __future__ import annotations

import atexit
import logging
import queue
import shutil
import threading
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np

from common.kv_store.file_store import FileBlockStore
from common.kv_store.fingerprint import fingerprint
from common.kv_store.store import BlockError, BlockStore
from common.messages import BlockLoad, BlockSave, BlocksLoaded, DiskReport
from common.server_args import ServerArgs
from common.sizes import format_size, parse_size
from worker_mlx.kv_pool import MlxKVPool

logger = logging.getLogger(__name__)

MAX_DEFAULT_BUDGET = 64 << 30
# how often the writer looks for blocks other servers wrote and saves the LRU order
RESCAN_SECONDS = 5.0
EXIT_DRAIN_SECONDS = 3.0


def unsupported(args: ServerArgs, has_states: bool) -> str | None:
    """Why this server cannot use the tier yet (None: it can)."""
    if has_states:
        return "recurrent layers (their states at block ends are not stored yet)"
    if args.speculative_algorithm == "draft":
        return "a draft model (its own pool would miss the loaded blocks)"
    if args.group_size > 1:
        return "a distributed worker (each rank holds a share of the pool)"
    return None


def default_budget(root: Path) -> int:
    """10% of the free space of the disk holding `root`, at most 64 GiB."""
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return min(shutil.disk_usage(probe).free // 10, MAX_DEFAULT_BUDGET)


def open_tier(args: ServerArgs, pool: MlxKVPool, has_states: bool) -> DiskTier | None:
    """The tier --kv-disk-dir asks for, or None (off, or a model it does not serve yet:
    one log line says which)."""
    if not args.kv_disk_dir:
        return None
    why = unsupported(args, has_states)
    if why is not None:
        logger.warning("--kv-disk-dir is ignored for this model: %s", why)
        return None
    root = Path(args.kv_disk_dir)
    budget = parse_size(args.kv_disk_budget) if args.kv_disk_budget else default_budget(root)
    block = args.kv_disk_block_tokens
    print_ = fingerprint(args.model_path, repr(pool.layout), block)
    store = FileBlockStore(root, print_, budget)
    used, blocks = store.usage()
    logger.info(
        "kv disk tier: %s, %d blocks of %d tokens (%s of %s)",
        store.dir, blocks, block, format_size(used), format_size(budget),
    )  # fmt: skip
    return DiskTier(store, pool, block)


class DiskTier:
    def __init__(self, store: BlockStore, pool: MlxKVPool, block_tokens: int):
        self.store = store
        self.pool = pool
        self.block_tokens = block_tokens
        self._lock = threading.Lock()
        self._errors: Counter[str] = Counter()
        self._reads: list[float] = []
        self._writes: list[float] = []
        self._added: list[str] = []
        self._scanned = time.monotonic()
        self._last_state = None
        # per pool part (layer by layer, K's parts then V's), the bytes of one token
        self._part_bytes = [
            p.dtype.size * int(np.prod(p.shape[1:])) for layer in pool.parts for p in layer
        ]
        self.loading = 0  # LoadBatches submitted and not answered yet
        self._queue: queue.Queue = queue.Queue()
        self._reads_queue: queue.Queue = queue.Queue()
        self._read_done: queue.Queue = queue.Queue()
        threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True).start()
        threading.Thread(target=self._read_loop, name="kv-disk-reader", daemon=True).start()
        # a stopped worker (the router's STOP_SIGNAL exits) writes what it queued first,
        # within the router's grace before its SIGKILL
        atexit.register(self.close, EXIT_DRAIN_SECONDS)

    # ------------------------------------------------------------ save

    def save(self, blocks: list[BlockSave]) -> None:
        """Copy the blocks' KV out of the pool now (the MLX thread, after the flush) and
        queue them for the writer thread."""
        if not blocks or not self.store.writable:
            return
        gathered = []
        for b in blocks:
            idx = mx.array(b.slots, dtype=mx.int32)
            gathered.append([p[idx] for layer in self.pool.parts for p in layer])
        mx.eval(gathered)
        for b, parts in zip(blocks, gathered):
            arrays = {f"p{i}": np.array(p.view(mx.uint8)) for i, p in enumerate(parts)}
            self._queue.put((b.key, b.parent, b.tokens, arrays))

    def _write_loop(self) -> None:
        while True:
            if time.monotonic() - self._scanned > RESCAN_SECONDS:
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
            with self._lock:
                if stored:
                    self._writes.append(time.perf_counter() - started)
                else:
                    self._errors["write"] += 1

    def _rescan(self) -> None:
        """Blocks other servers (replicas) sharing the directory wrote: the scheduler
        learns of them with the next report."""
        self._scanned = time.monotonic()
        self.store.save_index()  # the LRU order, for the next start (the files count)
        try:
            added = self.store.rescan()
        except OSError as exc:
            logger.warning("kv disk: rescanning the directory failed: %s", exc)
            return
        with self._lock:
            self._added += added

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until the queued writes are on disk (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self, timeout: float) -> None:
        self.drain(timeout)
        self.store.save_index()

    # ------------------------------------------------------------ load

    def submit(self, step: int, loads: list[BlockLoad]) -> None:
        """Queue a LoadBatch's blocks for the reader thread; `install_ready` writes them
        into the pool once read (the MLX thread goes on with its steps meanwhile)."""
        self.loading += 1
        self._reads_queue.put((step, loads))

    def _read_loop(self) -> None:
        while True:
            step, loads = self._reads_queue.get()
            blocks = []
            try:
                for load in loads:  # in order, up to the first that cannot be served
                    started = time.perf_counter()
                    blocks.append((load, self._read(load)))
                    with self._lock:
                        self._reads.append(time.perf_counter() - started)
            except BlockError as exc:
                logger.warning("kv disk: %s; recomputing from there", exc)
                with self._lock:
                    self._errors[exc.reason] += 1
            except Exception:  # a store's bug: the load ends there, its slots come back
                logger.exception("kv disk: reading blocks failed")
                with self._lock:
                    self._errors["missing"] += 1
            self._read_done.put((step, blocks))

    def _read(self, load: BlockLoad) -> list[np.ndarray]:
        """The block's raw parts, checked against this pool's layout (the reader thread:
        no MLX here)."""
        block = self.store.get(load.key)
        B = self.block_tokens
        if len(block.tokens) != B or len(load.slots) + load.offset != B:
            raise BlockError("foreign", f"block {load.key}: not a block of this server's size")
        raws = [block.arrays.get(f"p{i}") for i in range(len(self._part_bytes))]
        if any(r is None or r.size != B * n for r, n in zip(raws, self._part_bytes)):
            raise BlockError("foreign", f"block {load.key}: not this pool's layout")
        return raws

    def install_ready(self) -> list[BlocksLoaded]:
        """Write the blocks the reader has read into their slots (the MLX thread, between
        steps: a copy, no file I/O) and answer their LoadBatches."""
        answers = []
        while True:
            try:
                step, blocks = self._read_done.get_nowait()
            except queue.Empty:
                return answers
            stored = [p for layer in self.pool.parts for p in layer]
            per_layer = len(self.pool.parts[0])
            for load, raws in blocks:
                idx = mx.array(load.slots, dtype=mx.int32)
                parts = [
                    mx.array(raw)
                    .view(p.dtype)
                    .reshape(self.block_tokens, *p.shape[1:])[load.offset :]
                    for raw, p in zip(raws, stored)
                ]
                for layer in range(len(self.pool.parts)):
                    cut = parts[layer * per_layer : (layer + 1) * per_layer]
                    self.pool.write_parts(layer, idx, cut)
            mx.eval(self.pool.arrays())
            self.loading -= 1
            answers.append(BlocksLoaded(step, len(blocks)))

    # ------------------------------------------------------------ report

    def report(self) -> DiskReport | None:
        """What changed since the last report (None: nothing)."""
        usage = self.store.usage()
        dropped = self.store.take_dropped()
        with self._lock:
            news = DiskReport(
                usage[0], usage[1], dict(self._errors), self._reads, self._writes, dropped,
                self._added, self.store.writable,
            )  # fmt: skip
            self._errors, self._reads, self._writes, self._added = Counter(), [], [], []
        state = (usage, news.writable)
        if state == self._last_state and not (
            news.errors or news.read_seconds or news.write_seconds or dropped or news.added
        ):
            return None
        self._last_state = state
        return news
