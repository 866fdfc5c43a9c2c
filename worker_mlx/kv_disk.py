"""The disk tier on the worker's side: blocks copied out of the pool and written by a
writer thread, blocks read back into fresh pool slots, and the tier's report.

The copy out of the pool happens on the MLX thread when the ReleaseBatch that names the
blocks arrives (after its flush, before any later descriptor can reuse the slots): a
gather evaluated at once, handed to the writer thread as bytes. So a decode step never
waits for a file write, only for that copy. A load (LoadBatch) is read and checked by a
reader thread while the MLX thread goes on with its steps; between two steps the MLX
thread writes what was read into the pool (`install_ready`) and answers BlocksLoaded.

A model with recurrent layers also stores the state after a block's last token, when the
scheduler names one (`BlockSave.state_slot`), as an entry of its own (`state_key`), and
a load's last block brings it back into the state slot the scheduler chose.

A sliding-window model's block holds its full-attention layers' KV only; its sliding
layers' KV is stored (`window_key`) for the blocks the scheduler names (`BlockSave.window`:
those a later prompt's window reaches) and read back only for those (`BlockLoad.window`).

With a draft model (--speculative-algorithm draft), whose pool has the same slot ids, a
block holds the draft's KV of its tokens too, after the target's: a prefix loaded from
disk is then there for the draft as a pool hit is.

`worker_mlx/kv_disk_open.py` opens the tier (its directory, budget and fingerprint). A
distributed worker's ranks each keep their part of every block and agree on loads
(worker_mlx/kv_disk_group.py).

With --debug-invariants every installed block is read back from the pool and compared
with the bytes the store verified (its checksum), so a wrong copy fails loudly.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections import Counter

import mlx.core as mx
import numpy as np

from common.kv_store.block_keys import WINDOW_MARK, state_key, window_key
from common.kv_store.store import BlockError, BlockStore
from common.messages import BlockLoad, BlockSave, BlocksLoaded, DiskReport
from worker_mlx.kv_pool import MlxKVPool
from worker_mlx.state_pool import StatePool

logger = logging.getLogger(__name__)

# how often the writer looks for blocks other servers wrote and saves the LRU order
RESCAN_SECONDS = 5.0
EXIT_DRAIN_SECONDS = 3.0


def token_bytes(arrays: list[mx.array]) -> list[int]:
    """Per array, the bytes of one slot (its first axis indexes slots)."""
    return [a.dtype.size * int(np.prod(a.shape[1:])) for a in arrays]


class DiskTier:
    # a sliding-window model's blocks hold the full-attention layers' KV, the windowed
    # layers' apart where the scheduler asks (False: every layer's in every block)
    split_windows = True

    def __init__(
        self, store: BlockStore, pool: MlxKVPool, block_tokens: int,
        states: StatePool | None = None, verify: bool = False, draft: MlxKVPool | None = None,
    ):  # fmt: skip
        self.store = store
        self.pools = [pool] if draft is None else [pool, draft]  # a block's KV, in order
        self.block_tokens = block_tokens
        self.states = states
        self.verify = verify  # --debug-invariants: installed blocks are read back
        self._lock = threading.Lock()
        self._errors: Counter[str] = Counter()
        self._reads: list[float] = []
        self._writes: list[float] = []
        self._added: list[str] = []
        self._scanned = time.monotonic()
        self._last_state = None
        # per pool part (pool by pool, layer by layer, K's parts then V's), the bytes of
        # one token, and per state array, the bytes of one state slot
        self._part_bytes = token_bytes(self._parts())
        # per pool part, whether it is a sliding layer's (the target's; a draft has none),
        # and the largest window (0: none; a group's ranks store every layer's KV)
        windows = (pool.layout.windows if self.split_windows else ()) or (None,) * len(pool.parts)
        self._sliding = [w is not None for w, layer in zip(windows, pool.parts) for _ in layer]
        self._sliding += [False] * (len(self._part_bytes) - len(self._sliding))
        self.window = max((w for w in windows if w is not None), default=0)
        self._state_bytes = token_bytes(states.all()) if states is not None else []
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
            parts = self._parts()
            gathered.append([p[idx] for p, s in zip(parts, self._sliding) if not s])
            gathered[-1] += [p[idx] for p, s in zip(parts, self._sliding) if s and b.window]
            if b.state_slot and self.states is not None:  # the state after its last token
                gathered[-1] += [a[b.state_slot] for a in self.states.all()]
        mx.eval(gathered)
        n = self._sliding.count(False)
        for b, parts in zip(blocks, gathered):
            raw = [np.array(p.view(mx.uint8)) for p in parts]
            kv = {f"p{i}": r for i, r in enumerate(raw[:n])}
            self._queue.put((b.key, b.parent, b.tokens, kv))
            # after its block: a window or a state is only ever read with it
            w = self._sliding.count(True) if b.window else 0
            if w:
                arrays = {f"w{i}": r for i, r in enumerate(raw[n : n + w])}
                self._queue.put((window_key(b.key), b.key, [WINDOW_MARK], arrays))
            if len(raw) > n + w:
                arrays = {f"s{i}": r for i, r in enumerate(raw[n + w :])}
                self._queue.put((state_key(b.key), b.key, [], arrays))

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

    def _read(self, load: BlockLoad) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The block's raw parts and (`load.state_slot`) the state stored after it,
        checked against this pool's layout (the reader thread: no MLX here)."""
        block = self.store.get(load.key)
        B = self.block_tokens
        if len(block.tokens) != B or len(load.slots) + load.offset != B:
            raise BlockError("foreign", f"block {load.key}: not a block of this server's size")
        sizes = [B * n for n, s in zip(self._part_bytes, self._sliding) if not s]
        raws = _raw_arrays(block.arrays, "p", sizes)
        if raws is None:
            raise BlockError("foreign", f"block {load.key}: not this pool's layout")
        raws = self._with_window(load, raws)
        if not load.state_slot:
            return raws, []
        stored = self.store.get(state_key(load.key))
        states = _raw_arrays(stored.arrays, "s", self._state_bytes) if self.states else None
        if stored.tokens or stored.parent != load.key or states is None:
            raise BlockError("foreign", f"state after block {load.key}: not this model's layout")
        return raws, states

    def _with_window(self, load: BlockLoad, raws: list[np.ndarray]) -> list:
        """Every pool part's raw bytes in `_parts` order: a sliding layer's from the
        block's window entry when `load.window`, else None (its slots are left as is)."""
        if not any(self._sliding):
            return raws
        windows = iter([])
        if load.window:
            stored = self.store.get(window_key(load.key))
            sizes = [self.block_tokens * n for n, s in zip(self._part_bytes, self._sliding) if s]
            got = _raw_arrays(stored.arrays, "w", sizes)
            if stored.tokens != [WINDOW_MARK] or stored.parent != load.key or got is None:
                raise BlockError("foreign", f"window of block {load.key}: not this pool's layout")
            windows = iter(got)
        full = iter(raws)
        return [next(windows, None) if s else next(full) for s in self._sliding]

    def install_ready(self) -> list[BlocksLoaded]:
        """Write the blocks the reader has read into their slots (the MLX thread, between
        steps: a copy, no file I/O) and answer their LoadBatches."""
        answers = []
        while True:
            try:
                step, blocks = self._read_done.get_nowait()
            except queue.Empty:
                return answers
            answers.append(self._install_read(step, blocks))

    def _install_read(self, step: int, blocks: list) -> BlocksLoaded:
        """One LoadBatch's blocks the reader read, into the pool."""
        for load, (raws, states) in blocks:
            self._install(load, raws, states)
        mx.eval([a for pool in self.pools for a in pool.arrays()])
        mx.eval(self.states.all() if self.states else [])
        if self.verify:
            for load, (raws, states) in blocks:
                self._check_installed(load, raws, states)
        self.loading -= 1
        return BlocksLoaded(step, len(blocks))

    def known_keys(self) -> list[str]:
        """The blocks the scheduler may match at start-up."""
        return self.store.keys()

    def _install(self, load: BlockLoad, raws: list[np.ndarray], states: list[np.ndarray]):
        """A block's tokens from `load.offset` on into `load.slots` (and its state)."""
        idx = mx.array(load.slots, dtype=mx.int32)
        parts = [
            None  # a sliding layer's KV the block was loaded without: its slots stay as is
            if raw is None
            else mx.array(raw).view(p.dtype).reshape(self.block_tokens, *p.shape[1:])[load.offset :]
            for raw, p in zip(raws, self._parts())
        ]
        for pool in self.pools:
            for layer, stored in enumerate(pool.parts):
                if parts[0] is not None:
                    pool.write_parts(layer, idx, parts[: len(stored)])
                parts = parts[len(stored) :]
        for raw, a in zip(states, self.states.all() if states else []):
            a[load.state_slot] = mx.array(raw).view(a.dtype).reshape(a.shape[1:])

    def _check_installed(self, load: BlockLoad, raws, states) -> None:
        """--debug-invariants: the pool now holds exactly the verified bytes."""
        idx = mx.array(load.slots, dtype=mx.int32)
        for raw, p, n in zip(raws, self._parts(), self._part_bytes):
            if raw is None:
                continue
            got = np.array(p[idx].view(mx.uint8)).reshape(-1)
            if not np.array_equal(got, raw.reshape(-1)[load.offset * n :]):
                raise AssertionError(f"block {load.key}: the pool differs from the block read")
        for raw, a in zip(states, self.states.all() if states else []):
            if not np.array_equal(np.array(a[load.state_slot].view(mx.uint8)).reshape(-1), raw):
                raise AssertionError(f"state after block {load.key}: the pool differs")

    def _parts(self) -> list[mx.array]:
        """Every pool's stored arrays, in a block's order."""
        return [p for pool in self.pools for layer in pool.parts for p in layer]

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


def _raw_arrays(arrays: dict[str, np.ndarray], prefix: str, sizes: list[int]):
    """`prefix`0, 1, ... of a stored entry as flat bytes, or None unless there are exactly
    that many, of those sizes."""
    raws = [arrays.get(f"{prefix}{i}") for i in range(len(sizes))]
    if len(arrays) != len(sizes) or any(r is None or r.size != n for r, n in zip(raws, sizes)):
        return None
    return [r.reshape(-1) for r in raws]
