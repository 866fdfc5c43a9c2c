"""The disk tier on the worker's side: blocks copied out of the pool and written by a
writer thread, blocks read back into fresh pool slots, and the tier's report. `DiskTier`
is what the worker uses and holds what runs on the MLX thread; it is composed of the
writer thread (`BlockWriter`, worker_mlx/kv_disk_writer.py), the reader thread
(`BlockReader`, worker_mlx/kv_disk_reader.py) and the counts it reports (`TierCounts`,
worker_mlx/kv_disk_report.py).

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

import mlx.core as mx
import numpy as np

from common.kv_store.block_keys import WINDOW_MARK, state_key, window_key
from common.kv_store.store import BlockStore
from common.messages import BlockLoad, BlockSave, BlocksLoaded, DiskReport
from worker_mlx.kv_disk_reader import BlockReader, ReadLoad
from worker_mlx.kv_disk_report import TierCounts
from worker_mlx.kv_disk_writer import BlockWriter
from worker_mlx.kv_pool import MlxKVPool
from worker_mlx.state_pool import StatePool

logger = logging.getLogger(__name__)

EXIT_DRAIN_SECONDS = 3.0
MIN_RUN = 8  # consecutive slots a load writes with a slice copy rather than a scatter


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
        self.installed = 0  # LoadBatches written into the pool
        self.trace = lambda *event: None  # the worker's Trace (--trace-dir)
        self._committed: set[int] = set()  # steps submitted through the inbox
        self._landed: dict[int, ReadLoad] = {}  # read, waiting for `submit` (MLX thread)
        self.counts = TierCounts(store)
        self.writer = BlockWriter(store, self.counts, self._rescan)
        self.reader = BlockReader(
            store, block_tokens, self._part_bytes, self._sliding,
            self._state_bytes if states is not None else None, self.counts,
            lambda *event: self.trace(*event),  # (the worker sets `trace` later)
        )  # fmt: skip
        # the reader wakes the worker's loop through this pipe (in its poller)
        self.wake_fd = self.reader.wake_fd
        # a stopped worker (the router's STOP_SIGNAL exits) writes what it queued first,
        # within the router's grace before its SIGKILL
        atexit.register(self.close, EXIT_DRAIN_SECONDS)

    # ------------------------------------------------------------ save

    def save(self, blocks: list[BlockSave]) -> None:
        """Copy the blocks' KV out of the pool now (the MLX thread, after the flush) and
        queue them for the writer thread: one numpy gather from each pool part's memory
        for all the blocks (and the sliding parts of those with a window); a block's
        arrays are views of those."""
        if not blocks or not self.store.writable:
            return
        parts, windowed = self._parts(), [b for b in blocks if b.window]
        every = np.array([s for b in blocks for s in b.slots])
        raw = [_bytes_view(p)[every] for p, s in zip(parts, self._sliding) if not s]
        w = self._sliding.count(True) if windowed else 0
        if w:
            idx = np.array([s for b in windowed for s in b.slots])
            raw += [_bytes_view(p)[idx] for p, s in zip(parts, self._sliding) if s]
        for b in blocks:  # the state after its last token
            if b.state_slot and self.states is not None:
                raw += [_bytes_view(a)[b.state_slot].copy() for a in self.states.all()]
        n = self._sliding.count(False)
        full, windows, states = raw[:n], raw[n : n + w], iter(raw[n + w :])
        at, wat = 0, 0
        for b in blocks:
            rows = slice(at, at + len(b.slots))
            at += len(b.slots)
            kv = {f"p{i}": r[rows] for i, r in enumerate(full)}
            self.writer.put(b.key, b.parent, b.tokens, kv)
            # after its block: a window or a state is only ever read with it
            if b.window and w:
                arrays = {f"w{i}": r[wat : wat + len(b.slots)] for i, r in enumerate(windows)}
                wat += len(b.slots)
                self.writer.put(window_key(b.key), b.key, [WINDOW_MARK], arrays)
            if b.state_slot and self.states is not None:
                arrays = {f"s{i}": next(states) for i in range(len(self.states.all()))}
                self.writer.put(state_key(b.key), b.key, [], arrays)

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until the queued writes are on disk (tests, shutdown)."""
        self.writer.drain(timeout)

    def close(self, timeout: float) -> None:
        self.drain(timeout)
        self.store.save_index()

    def _rescan(self) -> None:
        """(The writer thread, every RESCAN_SECONDS.) Blocks other servers (replicas)
        sharing the directory wrote: the scheduler learns of them with the next report."""
        self.store.save_index()  # the LRU order, for the next start (the files count)
        try:
            added = self.store.rescan()
        except OSError as exc:
            logger.warning("kv disk: rescanning the directory failed: %s", exc)
            return
        self.counts.found(added)

    # ------------------------------------------------------------ load

    def submit(self, step: int, loads: list[BlockLoad]) -> None:
        """A LoadBatch through the worker's inbox (the MLX thread, after the releases
        before it): queue its blocks for the reader thread unless its copy through
        `receive_loads` came first; `install_ready` writes them into the pool once read
        (the MLX thread goes on with its steps meanwhile)."""
        self.loading += 1
        self._committed.add(step)  # from now on what is read may be written to the pool
        self.reader.arrived(step, loads, committed=True)

    def receive_loads(self, connect) -> None:
        """Take each LoadBatch's copy from the scheduler's socket for the tier as well
        (`connect()`, called on a thread of its own, gives the receive call: the next
        LoadBatch, or None) and start reading it at once: the MLX thread may be in a step,
        after which its copy through the inbox comes. What is read is written to the
        pool only once that copy came (`submit`)."""
        self.reader.receive_loads(connect)

    def answer_from_reader(self, connect) -> None:
        """Answer each LoadBatch from the reader thread as soon as it is read, with the
        sender `connect()` returns (called once, on that thread: a socket of its own),
        instead of from the MLX thread once installed. The scheduler can then admit the
        prompt while the worker is still in a step; the install, a copy, happens before
        the worker runs anything after that step (`install_ready` before each descriptor:
        the scheduler's next one comes after this answer, and the load's queued first)."""
        self.reader.answer_from_reader(connect)

    def install_ready(self) -> list[BlocksLoaded]:
        """Write the loads the reader has read, and whose LoadBatch came through the
        inbox, into their slots (the MLX thread, between steps: a copy, no file I/O) and
        answer those the reader did not."""
        self.reader.drain_wakes()  # before the queue: a later read wakes the loop again
        while True:
            try:
                read = self.reader.done.get_nowait()
            except queue.Empty:
                break
            self._landed[read.step] = read
        answers = []
        for step in sorted(self._landed.keys() & self._committed):
            read = self._landed.pop(step)
            answer = self._install_read(read)
            if not read.answered:
                answers.append(answer)
        return answers

    def _install_read(self, read: ReadLoad) -> BlocksLoaded:
        """One LoadBatch's blocks the reader read, into the pool."""
        self._committed.discard(read.step)
        self._install(read)
        self.reader.give_back(read.arena)
        if self.verify:
            for load, raws, states in read.blocks:
                self._check_installed(load, raws, states)
        self.loading -= 1
        self.installed += 1
        self.trace("installed", read.step)
        return BlocksLoaded(read.step, len(read.blocks))

    def known_keys(self) -> list[str]:
        """The blocks the scheduler may match at start-up."""
        return self.store.keys()

    def _install(self, read: ReadLoad) -> None:
        """A load's tokens into their slots (and the states), copied by numpy straight into
        the pool's memory: a slice per run of consecutive slots, an indexed copy for the
        rest (through MLX, an array per part, a slice update per run and an eval held the
        MLX thread several times as long: docs/performance.md). Nothing else touches these
        slots (the scheduler admits their prompt only once this load is answered), and
        whatever MLX still has to write into a part runs first (`_bytes_view`), so no
        pending update copies a buffer from before these writes."""
        parts = iter(read.parts)
        runs: dict[tuple[int, ...], list] = {}  # slots -> their (pool rows, load rows)
        for pool in self.pools:
            for stored in pool.parts:
                for p in stored:
                    slots, raw = next(parts)
                    if not slots:
                        continue
                    if slots not in runs:
                        runs[slots] = _slot_runs(slots)
                    rows = _bytes_view(p)
                    for target, source in runs[slots]:
                        rows[target] = raw[source]
        for load, _, states in read.blocks:
            for raw, a in zip(states, self.states.all() if states else []):
                _bytes_view(a)[load.state_slot] = raw.reshape(-1)

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
        """What changed since the last report (None: nothing). Both the MLX thread and
        the reader (its answers) report: one at a time."""
        return self.counts.report()


def _slot_runs(slots: tuple[int, ...]) -> list[tuple[slice | np.ndarray, slice | np.ndarray]]:
    """(pool rows, load rows) pairs that write a load's tokens into `slots`: a slice per
    run of at least MIN_RUN consecutive slots, then one index array for the rest."""
    runs, rest, at = [], [], 0
    while at < len(slots):
        end = at + 1
        while end < len(slots) and slots[end] == slots[end - 1] + 1:
            end += 1
        if end - at >= MIN_RUN:
            runs.append((slice(slots[at], slots[end - 1] + 1), slice(at, end)))
        else:
            rest += range(at, end)
        at = end
    if rest:
        runs.append((np.array([slots[i] for i in rest]), np.array(rest)))
    return runs


def _bytes_view(a: mx.array) -> np.ndarray:
    """A writable numpy view of an evaluated, row-contiguous MLX array's memory, one row
    of bytes per leading index (numpy has no bfloat16: through a uint8 view, which MLX
    gives the same buffer)."""
    flat = a.view(mx.uint8) if a.dtype == mx.bfloat16 else a
    mx.eval(flat)
    return np.asarray(memoryview(flat)).view(np.uint8).reshape(a.shape[0], -1)


def drain_wakes(tier: DiskTier) -> None:
    """Empty the reader's wake-up pipe (an `install_ready` that takes every read)."""
    tier.reader.drain_wakes()
