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
import os
import queue
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass

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
MIN_RUN = 8  # consecutive slots a load writes with a slice copy rather than a scatter
ARENA_KEEP_BYTES = 64 << 20  # a bigger load's arena is not kept for the next
WRITER_NICE = 10  # the writer thread's nice value, where threads have their own
ONCE_KEPT = 256  # LoadBatches remembered as come once (see `_arrived`)


@dataclass
class ReadLoad:
    """A LoadBatch as the reader thread hands it to the MLX thread."""

    step: int
    blocks: list[tuple[BlockLoad, list[np.ndarray], list[np.ndarray]]]  # raw parts, state
    # per pool part, the slots it writes (block after block) and those tokens' bytes
    parts: list[tuple[tuple[int, ...], np.ndarray | None]]
    arena: np.ndarray  # the memory `parts` are in, kept for the next load once installed
    answered: bool = False  # by the reader thread (`DiskTier.answer_from_reader`)


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
        self._report_lock = threading.Lock()
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
        self.installed = 0  # LoadBatches written into the pool
        self.trace = lambda *event: None  # the worker's Trace (--trace-dir)
        self._connect = None  # see `answer_from_reader`
        self._send = None  # the reader's sender, made on its thread
        self._both = False  # LoadBatches come twice (`receive_loads`)
        self._once: set[int] = set()  # steps of LoadBatches of which one copy came
        self._last_committed = -1
        self._committed: set[int] = set()  # steps submitted through the inbox
        self._landed: dict[int, ReadLoad] = {}  # read, waiting for `submit` (MLX thread)
        self._arenas: list[np.ndarray] = []  # see `_assemble`
        self._queue: queue.Queue = queue.Queue()
        self._reads_queue: queue.Queue = queue.Queue()
        self._read_done: queue.Queue = queue.Queue()
        # the reader wakes the worker's loop through this pipe (`wake_fd`, in its poller)
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self.wake_fd = self._wake_read
        threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True).start()
        threading.Thread(target=self._read_loop, name="kv-disk-reader", daemon=True).start()
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
            self._queue.put((b.key, b.parent, b.tokens, kv))
            # after its block: a window or a state is only ever read with it
            if b.window and w:
                arrays = {f"w{i}": r[wat : wat + len(b.slots)] for i, r in enumerate(windows)}
                wat += len(b.slots)
                self._queue.put((window_key(b.key), b.key, [WINDOW_MARK], arrays))
            if b.state_slot and self.states is not None:
                arrays = {f"s{i}": next(states) for i in range(len(self.states.all()))}
                self._queue.put((state_key(b.key), b.key, [], arrays))

    def _write_loop(self) -> None:
        _yield_cpu()
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
        """A LoadBatch through the worker's inbox (the MLX thread, after the releases
        before it): queue its blocks for the reader thread unless its copy through
        `receive_loads` came first; `install_ready` writes them into the pool once read
        (the MLX thread goes on with its steps meanwhile)."""
        self.loading += 1
        self._committed.add(step)  # from now on what is read may be written to the pool
        self._arrived(step, loads, committed=True)

    def receive_loads(self, connect) -> None:
        """Take each LoadBatch's copy from the scheduler's socket for the tier as well
        (`connect()`, called on a thread of its own, gives the receive call: the next
        LoadBatch, or None) and start reading it at once: the MLX thread may be in a step,
        after which its copy through the inbox comes. What is read is written to the
        pool only once that copy came (`submit`)."""
        self._both = True
        threading.Thread(
            target=self._receive_loop, args=(connect,), name="kv-disk-loads", daemon=True
        ).start()

    def _receive_loop(self, connect) -> None:
        receive = connect()
        while True:
            try:
                msg = receive()
            except Exception:  # a bad frame: its copy through the inbox still comes
                logger.exception("kv disk: a load's copy could not be read")
                continue
            if msg is not None:
                self._arrived(msg.step, msg.loads, committed=False)

    def _arrived(self, step: int, loads: list[BlockLoad], committed: bool) -> None:
        """A LoadBatch's first copy is read; with `receive_loads`, each comes twice.
        (Steps grow: a copy through the tier's socket older than the last through the
        inbox was sent to a worker before this one, or its twin came first.)"""
        with self._lock:
            if committed:
                self._last_committed = max(self._last_committed, step)
            if self._both:
                if step in self._once:
                    self._once.remove(step)
                    return
                if not committed and step <= self._last_committed:
                    return
                self._once.add(step)
                if len(self._once) > ONCE_KEPT:  # twins the scheduler could not send
                    self._once = {s for s in self._once if s > self._last_committed}
        self._reads_queue.put((step, loads))

    def _read_loop(self) -> None:
        while True:
            step, loads = self._reads_queue.get()
            blocks = []
            try:
                for load in loads:  # in order, up to the first that cannot be served
                    started = time.perf_counter()
                    blocks.append((load, *self._read(load)))
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
            read = self._assemble(step, blocks)
            read.answered = self._connect is not None
            self._read_done.put(read)  # before the answer: see `answer_from_reader`
            self.trace("read", step)
            _wake(self._wake_write)
            if read.answered:
                self._answer(read)

    def answer_from_reader(self, connect) -> None:
        """Answer each LoadBatch from the reader thread as soon as it is read, with the
        sender `connect()` returns (called once, on that thread: a socket of its own),
        instead of from the MLX thread once installed. The scheduler can then admit the
        prompt while the worker is still in a step; the install, a copy, happens before
        the worker runs anything after that step (`install_ready` before each descriptor:
        the scheduler's next one comes after this answer, and the load's queued first)."""
        self._connect = connect

    def _answer(self, read: ReadLoad) -> None:
        if self._send is None:
            self._send = self._connect()
        answer = BlocksLoaded(read.step, len(read.blocks))
        answer.disk = self.report()
        self._send(answer)

    def _assemble(self, step: int, blocks: list) -> ReadLoad:
        """Per pool part, the blocks' tokens (from each load's offset) laid end to end,
        here on the reader thread, so the MLX thread writes a load with a few copies per
        part, not one per block and layer. (A block's part read as None is left out: its
        slots keep what they hold.) They go into an arena the last install gave back:
        fresh memory costs more in page faults than the copy itself."""
        plan, slots_of = [], {}  # the parts' rows come from the same blocks: slots once
        for i, n in enumerate(self._part_bytes):
            rows = [(load, raws[i]) for load, raws, _ in blocks if raws[i] is not None]
            which = tuple(id(load) for load, _ in rows)
            if which not in slots_of:
                slots_of[which] = tuple(s for load, _ in rows for s in load.slots)
            plan.append((n, rows, slots_of[which]))
        arena = self._arena(sum(n * len(slots) for n, _, slots in plan))
        parts, at = [], 0
        for n, rows, slots in plan:
            out = arena[at : at + n * len(slots)].reshape(len(slots), n)
            row = 0
            for load, raw in rows:
                piece = raw.reshape(-1, n)[load.offset :]
                out[row : row + len(piece)] = piece
                row += len(piece)
            parts.append((slots, out if rows else None))
            at += out.size
        return ReadLoad(step, blocks, parts, arena)

    def _arena(self, size: int) -> np.ndarray:
        with self._lock:
            if self._arenas and self._arenas[-1].size >= size:
                return self._arenas.pop()
        return np.empty(max(size, 1 << 20), np.uint8)

    def _read(self, load: BlockLoad) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The block's raw parts and (`load.state_slot`) the state stored after it,
        checked against this pool's layout (the reader thread: no MLX here)."""
        block = self.store.get(load.key)
        B = len(block.tokens)  # a request's tail is a block of fewer tokens
        if not 0 < B <= self.block_tokens or len(load.slots) + load.offset != B:
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
        """Write the loads the reader has read, and whose LoadBatch came through the
        inbox, into their slots (the MLX thread, between steps: a copy, no file I/O) and
        answer those the reader did not."""
        _drain(self._wake_read)  # before the queue: a later read wakes the loop again
        while True:
            try:
                read = self._read_done.get_nowait()
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
        with self._lock:  # copied into the pool: the biggest arena serves the next load
            kept = [a for a in (*self._arenas, read.arena) if a.size <= ARENA_KEEP_BYTES]
            self._arenas = sorted(kept, key=len)[-1:]
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
        rest. Through MLX (an array per part, a slice update per run, an eval) the same
        copy took 2-3 ms of the MLX thread for 1k tokens of the small model, numpy 0.4.
        Nothing else touches these slots (the scheduler admits their prompt only once
        this load is answered), and whatever MLX still has to write into a part runs
        first (`_bytes_view`), so no pending update copies a buffer from before these
        writes."""
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
        with self._report_lock:
            return self._report()

    def _report(self) -> DiskReport | None:
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


def _wake(fd: int) -> None:
    try:
        os.write(fd, b"\0")
    except BlockingIOError:
        pass  # the pipe is full of wake-ups already


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def drain_wakes(tier: DiskTier) -> None:
    """Empty the reader's wake-up pipe (an `install_ready` that takes every read)."""
    _drain(tier.wake_fd)
