"""DecodeBuffer: the running requests' KV as left-padded rows of one buffer per layer.

Row r holds one request's KV in columns [left_pad[r], idx); a decode step writes column
idx of every row (`step`) and the capacity doubles when full. Columns [flushed, idx) are
decode KV that is only here: `flush` scatters them into the pool at the request's last
slots. This object keeps the rows and columns; the data is in composed stores, one per
kind of cache (column_stores.py): the float KV columns every step attends, a quantized
pool's stored parts, the recurrent layers' per-row states, and speculation's holes
(holes.py). The KVLedger (kv_ledger.py) builds buffers, seats and releases their rows
and decides when to flush; `KVLedger.where` says where a request's KV is.

When requests leave, their rows go dead (computed, never read) and requests that join
later take them over (`seat`), so a change in the running set costs the joining rows,
not a rebuild of every row from the pool.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import mlx.core as mx

from worker_mlx.column_stores import (
    KVColumns,
    NoRecurrentRows,
    QuantizedParts,
    RecurrentRows,
    gather_stores,
)
from worker_mlx.decode_step import DecodeStep
from worker_mlx.holes import Holes
from worker_mlx.kv_pool import MlxKVPool
from worker_mlx.state_pool import StatePool


class DecodeBuffer:
    GROW_STEP = 256
    # Columns of left padding shared by every live row past which `seat` shifts them out.
    COMPACT_COLUMNS = 128

    def __init__(
        self, pool: MlxKVPool, rids: list[str], slots: list[list[int]], free_columns: int = 1,
        states: StatePool | None = None, state_slots: list[int] = (),
        state_from: list[int] | None = None, skips: list[int] = (),
    ):  # fmt: skip
        """Rows `rids` with their KV at `slots` from the pool; over recurrent layers
        (`states`), each row's state gathered from `state_from` (default: the rows' own
        working `state_slots`) and flushed to the working slots; `skips`: the RoPE
        positions each row's prompt skips (holes.py)."""
        self.pool = pool
        # row -> request (None: a dead row); a copy, as the caller's list may change
        self.rids: list[str | None] = list(rids)
        lens = [len(s) for s in slots]
        T = max(lens)
        cap = _round_up(T + free_columns, self.GROW_STEP)
        self.left_pad = [T - n for n in lens]
        self.idx = T  # next column to write
        self.flushed = T  # columns before this are already in the pool
        self.kv, self.quantized = gather_stores(pool, self._head_index(slots, T, cap))
        self.recurrent: RecurrentRows | NoRecurrentRows = NoRecurrentRows()
        if states is not None:
            self.recurrent = RecurrentRows(states, state_slots, state_from)
        self.holes = Holes(len(rids), cap, skips)
        self._left_pad_arr = mx.array(self.left_pad, dtype=mx.int32)

    def _head_index(self, slots: list[list[int]], T: int, cap: int) -> mx.array:
        """Pool indices of rows of `slots` ending just before column T, `cap` wide."""
        rows = [[0] * (T - len(s)) + s + [0] * (cap - T) for s in slots]
        return self.pool.head_index(mx.array(rows))

    def _stores(self) -> list[KVColumns | QuantizedParts]:
        return [self.kv] + ([self.quantized] if self.quantized is not None else [])

    def nbytes(self) -> int:
        """Bytes the buffer's KV arrays hold."""
        return sum(a.nbytes for store in self._stores() for a in store.arrays())

    # ------------------------------------------------------------ rows

    def rows(self, rids: list[str]) -> list[int] | None:
        """The row of each of `rids`; None unless the live rows are exactly `rids`."""
        row_of = {rid: i for i, rid in enumerate(self.rids) if rid is not None}
        if len(row_of) != len(rids) or any(rid not in row_of for rid in rids):
            return None
        return [row_of[rid] for rid in rids]

    def serves(self, rids: list[str]) -> bool:
        """Whether the live rows are exactly `rids` and dead rows do not outnumber them."""
        if self._mostly_dead(self.rids.count(None)) or self.holes.too_many(self.idx):
            return False
        return self.rows(rids) is not None

    def columns(self, rid: str) -> tuple[int, range] | None:
        """(row, the columns holding its KV) of `rid`, or None if it has no row."""
        if rid not in self.rids:
            return None
        row = self.rids.index(rid)
        return row, range(self.left_pad[row], self.idx)

    def _mostly_dead(self, dead: int) -> bool:
        """Past this a rebuild is cheaper than computing the dead rows every step."""
        return 2 * dead > len(self.rids)

    def drop(self, rids: Collection[str]) -> None:
        """Rows of requests that left go dead (flush them first if their KV is wanted)."""
        self.rids = [None if rid in rids else rid for rid in self.rids]

    def seat(
        self, rids: list[str], slots: list[list[int]], state_slots: list[int] = (),
        skips: list[int] = (),
    ) -> bool:  # fmt: skip
        """Make the live rows exactly `rids` (whose KV must all be in the pool): requests
        that left go dead, joining ones take dead rows. False when a rebuild is due: the
        joining ones do not fit (no dead row, or more tokens than columns before the next
        one), or dead rows would outnumber live ones."""
        live = set(rids)
        self.drop({rid for rid in self.rids if rid not in live})
        seated = set(self.rids)
        joining = [(rid, s) for rid, s in zip(rids, slots) if rid not in seated]
        free = [i for i, rid in enumerate(self.rids) if rid is None]
        dead_after = len(free) - len(joining)
        if dead_after < 0 or self._mostly_dead(dead_after) or self.pending() or self.holes.columns:
            return False
        if any(len(s) > self.idx for _, s in joining):
            return False
        if joining:
            self._fill(free[: len(joining)], [s for _, s in joining])
            homes = dict(zip(rids, state_slots))
            self.recurrent.fill(free[: len(joining)], [homes.get(rid, 0) for rid, _ in joining])
            skip_of = dict(zip(rids, skips))
            self.holes.seat(free[: len(joining)], [skip_of.get(rid, 0) for rid, _ in joining])
        for row, (rid, s) in zip(free, joining):
            self.rids[row] = rid
            self.left_pad[row] = self.idx - len(s)
        self._compact()
        self._left_pad_arr = mx.array(self.left_pad, dtype=mx.int32)
        return True

    def reseat(self, rid: str, length: int) -> None:
        """Seat `rid` on the single row, whose first `length` tokens are already its KV:
        the next step writes the column after them (Lookahead's kept buffer)."""
        self.rids = [rid]
        self.idx = self.flushed = self.left_pad[0] + length

    # ------------------------------------------------------------ steps and flush

    def step(self, step: DecodeStep, tokens: mx.array) -> mx.array:
        """One decode step of every row (tokens (B, S)): writes the S columns from `idx`;
        the logits, (B, V) for S == 1, else (B, S, V)."""
        S = tokens.shape[1]
        self._make_room(S)
        recurrent, quantized = self.recurrent, self.quantized
        logits, keys, values, state, parts = step(
            tokens, self.idx, self._left_pad_arr, self.kv.keys, self.kv.values,
            list(recurrent.state),
            quantized.parts if quantized is not None else [],
            self.holes.marks, self.holes.gaps,
        )  # fmt: skip
        self.kv.replace(keys, values)
        recurrent.replace(state)
        if quantized is not None:
            quantized.replace(parts)
        self.idx += S
        return logits

    def reject(self, rejected: list[int]) -> None:
        """After a verify step: the last `rejected[row]` columns of each row hold no token."""
        self.holes.reject(rejected, self.idx)

    def take_back(self, column: int, state: list[list[mx.array]] | None = None) -> None:
        """Forget the columns from `column` on (steps computed ahead that were not wanted):
        the next step writes there; the recurrent layers' states become `state`, theirs
        before those steps."""
        self.idx = column
        if state is not None:
            self.recurrent.replace(state)

    def pending(self) -> int:
        """Decode tokens per row that are only in the buffer, not yet in the pool."""
        return self.idx - self.flushed

    def flush(self, slots_of: Callable[[str], list[int]], skip: Collection[str] = ()) -> None:
        """Scatter the unflushed columns of every live row but `skip` into the pool, at the
        last slots of `slots_of(rid)`; skipped rows' KV is dropped."""
        n = self.pending()
        rows = [i for i, rid in enumerate(self.rids) if rid is not None and rid not in skip]
        if n and rows:
            row_idx = mx.array(rows, dtype=mx.int32)
            flat_slots = mx.array(
                [s for i in rows for s in slots_of(self.rids[i])[-n:]], dtype=mx.int32
            )
            cols = slice(self.flushed, self.idx)
            for store in self._stores():
                store.write(self.pool, flat_slots, row_idx, cols)
            self.recurrent.write(rows)
        self.flushed = self.idx

    def arrays(self) -> list[mx.array]:
        stores = [*self._stores(), self.recurrent]
        return [a for store in stores for a in store.arrays()]

    # ------------------------------------------------------------ columns

    def _fill(self, rows: list[int], slots: list[list[int]]) -> None:
        """Joining requests' KV from the pool into `rows`, one whole row at a time: a row of
        the buffer's full width is a size MLX's buffer cache has seen before, where a
        gather sized by the current column needed fresh, page-faulted memory each time (6%
        more shared-prefix throughput)."""
        cap = self.kv.capacity
        for row, row_slots in zip(rows, slots):
            kv, quantized = gather_stores(self.pool, self._head_index([row_slots], self.idx, cap))
            at = mx.array([row], dtype=mx.int32)
            self.kv.fill(at, kv)
            if quantized is not None:
                self.quantized.fill(at, quantized)

    def _compact(self) -> None:
        """Shift out the columns that are left padding in every live row. Joining requests
        take the columns just before `idx`, which only grows, so a buffer that lives
        across joins (steady traffic never empties it) would otherwise keep the columns
        of long-gone requests: every step attends over them and the capacity keeps
        doubling. Costs one copy of the buffer; needs no unflushed columns."""
        shift = min(
            (pad for pad, rid in zip(self.left_pad, self.rids) if rid is not None), default=0
        )
        if shift < self.COMPACT_COLUMNS:
            return
        width = self.idx - shift
        self._recolumn(shift, width, _round_up(width + 1, self.GROW_STEP))
        self.idx = self.flushed = width
        self.left_pad = [max(pad - shift, 0) for pad in self.left_pad]  # dead rows: any

    def _make_room(self, columns: int = 1) -> None:
        """Double the capacity when the `columns` from `idx` do not fit; the only
        concatenation, amortised over many steps."""
        cap = self.kv.capacity
        if self.idx + columns > cap:
            self._recolumn(0, cap, 2 * cap)

    def _recolumn(self, start: int, width: int, cap: int) -> None:
        """Every store's columns become [start, start + width), zero-padded to `cap`."""
        for store in self._stores():
            store.recolumn(start, width, cap)
        self.holes.recolumn(start, width, cap)


def _round_up(n: int, step: int) -> int:
    return (n + step - 1) // step * step
