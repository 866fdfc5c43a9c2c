"""The disk tier's reader thread: a LoadBatch's blocks read from the store and checked
against this pool's layout while the MLX thread goes on with its steps, then laid end to
end per pool part in an arena, so that between two steps the MLX thread only copies
them into the pool (`DiskTier.install_ready`, worker_mlx/kv_disk.py). No MLX here: bytes
only.

A LoadBatch comes through the worker's inbox (`DiskTier.submit`) and, with
`receive_loads`, also from the scheduler's socket on a thread of its own, so the read
starts at once even while the MLX thread is in a step; whichever copy comes first is
read. With `answer_from_reader` the reader answers BlocksLoaded itself as soon as the
blocks are read, and it wakes the worker's loop through a pipe (`wake_fd`).

A block's entry holds its pool parts' bytes (a draft model's after the target's); a
recurrent model's load brings the state stored after its last block (`state_key`), and
a sliding-window model's the windowed layers' KV of the blocks the scheduler names
(`BlockLoad.window`, from `window_key`), the other blocks' windowed parts left as they
are.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from common.kv_store.block_keys import WINDOW_MARK, state_key, window_key
from common.kv_store.store import BlockError, BlockStore
from common.messages import BlockLoad, BlocksLoaded
from worker_mlx.kv_disk_report import TierCounts

logger = logging.getLogger(__name__)

ARENA_KEEP_BYTES = 64 << 20  # a bigger load's arena is not kept for the next
ONCE_KEPT = 256  # LoadBatches remembered as come once (see `arrived`)


@dataclass
class ReadLoad:
    """A LoadBatch as the reader thread hands it to the MLX thread."""

    step: int
    blocks: list[tuple[BlockLoad, list[np.ndarray], list[np.ndarray]]]  # raw parts, state
    # per pool part, the slots it writes (block after block) and those tokens' bytes
    parts: list[tuple[tuple[int, ...], np.ndarray | None]]
    arena: np.ndarray  # the memory `parts` are in, kept for the next load once installed
    answered: bool = False  # by the reader thread (`BlockReader.answer_from_reader`)


class BlockReader:
    """The reader thread. `part_bytes`: per pool part (pool by pool, layer by layer, K's
    parts then V's), the bytes of one token; `sliding`: per pool part, whether it is a
    sliding layer's stored apart; `state_bytes`: per state array, the bytes of one state
    slot (None: the model has no states); `trace`: the worker's Trace."""

    def __init__(
        self, store: BlockStore, block_tokens: int, part_bytes: list[int], sliding: list[bool],
        state_bytes: list[int] | None, counts: TierCounts, trace: Callable[..., None],
    ):  # fmt: skip
        self.store = store
        self.block_tokens = block_tokens
        self._part_bytes = part_bytes
        self._sliding = sliding
        self._state_bytes = state_bytes
        self.counts = counts
        self._trace = trace
        self._lock = threading.Lock()  # the twins' bookkeeping and the arenas
        self._connect = None  # see `answer_from_reader`
        self._send = None  # the reader's sender, made on its thread
        self._both = False  # LoadBatches come twice (`receive_loads`)
        self._once: set[int] = set()  # steps of LoadBatches of which one copy came
        self._last_committed = -1
        self._arenas: list[np.ndarray] = []  # see `assemble`
        self._reads_queue: queue.Queue = queue.Queue()
        self.done: queue.Queue = queue.Queue()  # ReadLoads, for the MLX thread
        # the reader wakes the worker's loop through this pipe (`wake_fd`, in its poller)
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self.wake_fd = self._wake_read
        threading.Thread(target=self._read_loop, name="kv-disk-reader", daemon=True).start()

    def receive_loads(self, connect) -> None:
        """See `DiskTier.receive_loads`."""
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
                self.arrived(msg.step, msg.loads, committed=False)

    def arrived(self, step: int, loads: list[BlockLoad], committed: bool) -> None:
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
                    self.counts.read(time.perf_counter() - started)
            except BlockError as exc:
                logger.warning("kv disk: %s; recomputing from there", exc)
                self.counts.error(exc.reason)
            except Exception:  # a store's bug: the load ends there, its slots come back
                logger.exception("kv disk: reading blocks failed")
                self.counts.error("missing")
            read = self.assemble(step, blocks)
            read.answered = self._connect is not None
            self.done.put(read)  # before the answer: see `answer_from_reader`
            self._trace("read", step)
            _wake(self._wake_write)
            if read.answered:
                self._answer(read)

    def answer_from_reader(self, connect) -> None:
        """See `DiskTier.answer_from_reader`."""
        self._connect = connect

    def _answer(self, read: ReadLoad) -> None:
        if self._send is None:
            self._send = self._connect()
        answer = BlocksLoaded(read.step, len(read.blocks))
        answer.disk = self.counts.report()
        self._send(answer)

    def drain_wakes(self) -> None:
        """Empty the wake-up pipe (before taking what is read: a later read wakes the
        worker's loop again)."""
        _drain(self._wake_read)

    def assemble(self, step: int, blocks: list) -> ReadLoad:
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

    def give_back(self, arena: np.ndarray) -> None:
        """An installed load's arena (copied into the pool): the biggest arena serves
        the next load."""
        with self._lock:
            kept = [a for a in (*self._arenas, arena) if a.size <= ARENA_KEEP_BYTES]
            self._arenas = sorted(kept, key=len)[-1:]

    def _read(self, load: BlockLoad) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The block's raw parts and (`load.state_slot`) the state stored after it,
        checked against this pool's layout."""
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
        states = None
        if self._state_bytes is not None:
            states = _raw_arrays(stored.arrays, "s", self._state_bytes)
        if stored.tokens or stored.parent != load.key or states is None:
            raise BlockError("foreign", f"state after block {load.key}: not this model's layout")
        return raws, states

    def _with_window(self, load: BlockLoad, raws: list[np.ndarray]) -> list:
        """Every pool part's raw bytes in the block's order: a sliding layer's from the
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


def _raw_arrays(arrays: dict[str, np.ndarray], prefix: str, sizes: list[int]):
    """`prefix`0, 1, ... of a stored entry as flat bytes, or None unless there are exactly
    that many, of those sizes."""
    raws = [arrays.get(f"{prefix}{i}") for i in range(len(sizes))]
    if len(arrays) != len(sizes) or any(r is None or r.size != n for r, n in zip(raws, sizes)):
        return None
    return [r.reshape(-1) for r in raws]


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
