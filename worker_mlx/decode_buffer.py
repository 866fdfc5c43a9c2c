"""DecodeBuffer: the running requests' KV as left-padded rows of one buffer per layer.

Row r holds one request's KV in columns [left_pad[r], idx); a decode step writes column
idx of every row (`step`) and the capacity doubles when full. Columns [flushed, idx) are
decode KV that is only here: `flush` scatters them into the pool at the request's last
slots. Everything about where a row's KV sits is this object's; `ModelRunner.kv_location`
puts it together with the pool's part.

When requests leave, their rows go dead (computed, never read) and requests that join
later take them over (`admit`), so a change in the running set costs the joining rows,
not a rebuild of every row from the pool.

A model's recurrent layers keep one state per row here, not per column: a step replaces
it, `flush` writes it to the row's working state slot with the columns.

The buffers hold K/V decoded, as the pool hands them back (`kv_codec`), so a step attends
floats. Over a quantized pool each layer also keeps the stored parts of every column
(`parts`), gathered with the rows and written by each step: the flush writes those, as
quantizing decoded values again would not give back the same codes.

A speculative verify step (`step` with S tokens a row) writes S columns; the columns of
a row's rejected drafts become holes, masked out and skipped by RoPE positions, so rows
that accepted different numbers of drafts keep sharing the write column. Holes go away
with the next rebuild (`admit` refuses while there are any, `too_holey` asks for one).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import mlx.core as mx

from worker_mlx.decode_step import DecodeStep
from worker_mlx.kv_pool import MlxKVPool
from worker_mlx.state_pool import StatePool


class DecodeBuffer:
    GROW_STEP = 256
    # Columns of left padding shared by every live row past which `admit` shifts them out.
    COMPACT_COLUMNS = 128

    def __init__(
        self, pool: MlxKVPool, rids: list[str], slots: list[list[int]], free_columns: int = 1,
        states: StatePool | None = None, state_slots: list[int] = (),
        state_from: list[int] | None = None,
    ):  # fmt: skip
        self.pool = pool
        # recurrent layers: each row's state, gathered from `state_from` (default: the
        # rows' own working `state_slots`) and flushed to the working slots
        self.states = states
        self.state_home: list[int] = list(state_slots)
        self.state = self._gather_states(state_from if state_from is not None else state_slots)
        self._state_before: list[list[mx.array]] | None = None
        # row -> request (None: a dead row); a copy, as the caller's list may change
        self.rids: list[str | None] = list(rids)
        lens = [len(s) for s in slots]
        T = max(lens)
        cap = _round_up(T + free_columns, self.GROW_STEP)
        self.left_pad = [T - n for n in lens]
        self.idx = T  # next column to write
        self.flushed = T  # columns before this are already in the pool
        self.keys, self.values, self.parts = self._gather(slots, T, cap)
        self._left_pad_arr = mx.array(self.left_pad, dtype=mx.int32)
        # speculative steps' rejected columns: (B, cap) marks, and their count per row
        self.holes = mx.zeros((len(rids), cap), dtype=mx.bool_)
        self.gaps = mx.zeros((len(rids),), dtype=mx.int32)
        self.hole_counts = [0] * len(rids)
        self.hole_columns = 0  # the most holes any row has

    def nbytes(self) -> int:
        """Bytes the buffer's arrays hold."""
        parts = [p for layer in self.parts for p in layer] if self.parts else []
        return sum(a.nbytes for a in [*self.keys, *self.values, *parts])

    # ------------------------------------------------------------ rows

    def rows(self, rids: list[str]) -> list[int] | None:
        """The row of each of `rids`; None unless the live rows are exactly `rids`."""
        row_of = {rid: i for i, rid in enumerate(self.rids) if rid is not None}
        if len(row_of) != len(rids) or any(rid not in row_of for rid in rids):
            return None
        return [row_of[rid] for rid in rids]

    def serves(self, rids: list[str]) -> bool:
        """Whether the live rows are exactly `rids` and dead rows do not outnumber them."""
        if self._mostly_dead(self.rids.count(None)) or self.too_holey():
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

    def admit(self, rids: list[str], slots: list[list[int]], state_slots: list[int] = ()) -> bool:
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
        if dead_after < 0 or self._mostly_dead(dead_after) or self.pending() or self.hole_columns:
            return False
        if any(len(s) > self.idx for _, s in joining):
            return False
        if joining:
            self._fill(free[: len(joining)], [s for _, s in joining])
            if self.states is not None:
                homes = dict(zip(rids, state_slots))
                self._fill_states(free[: len(joining)], [homes[rid] for rid, _ in joining])
        for row, (rid, s) in zip(free, joining):
            self.rids[row] = rid
            self.left_pad[row] = self.idx - len(s)
        self._compact()
        self._left_pad_arr = mx.array(self.left_pad, dtype=mx.int32)
        return True

    def rewind(self, rid: str, length: int) -> None:
        """Seat `rid` on the single row, whose first `length` tokens are already its KV
        (the same prompt again): the next step writes the column after them."""
        self.rids = [rid]
        self.idx = self.flushed = self.left_pad[0] + length

    # ------------------------------------------------------------ steps and flush

    def step(self, step: DecodeStep, tokens: mx.array) -> mx.array:
        """One decode step of every row (tokens (B, S)): writes the S columns from `idx`;
        the logits, (B, V) for S == 1, else (B, S, V)."""
        S = tokens.shape[1]
        self._make_room(S)
        self._state_before = self.state
        logits, self.keys, self.values, self.state, self.parts = step(
            tokens, self.idx, self._left_pad_arr, self.keys, self.values, self.state,
            self.parts, self.holes, self.gaps,
        )  # fmt: skip
        self.idx += S
        return logits

    def reject(self, rejected: list[int]) -> None:
        """After a verify step: the last `rejected[row]` columns of each row hold no token."""
        if not any(rejected):
            return
        n = mx.array(rejected, dtype=mx.int32)
        cols = mx.arange(self.keys[0].shape[2])
        self.holes = self.holes | ((cols >= self.idx - n[:, None]) & (cols < self.idx))
        self.gaps = self.gaps + n
        self.hole_counts = [a + b for a, b in zip(self.hole_counts, rejected)]
        self.hole_columns = max(self.hole_counts)

    def too_holey(self) -> bool:
        """Whether holes are a fifth of the columns a step attends: a rebuild is cheaper."""
        return 5 * self.hole_columns > self.idx

    def unstep(self) -> None:
        """Forget the last step (one computed ahead that was not wanted): the next step
        overwrites its column, and the recurrent states are the ones before it."""
        self.idx -= 1
        if self._state_before is not None:
            self.state = self._state_before

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
            for layer in range(len(self.keys)):
                if self.parts:
                    parts = [self._unflushed(p, row_idx) for p in self.parts[layer]]
                    self.pool.write_parts(layer, flat_slots, parts)
                    continue
                k = self._unflushed(self.keys[layer], row_idx)
                self.pool.write(layer, flat_slots, k, self._unflushed(self.values[layer], row_idx))
        if n and rows and self.states is not None:
            row_idx = mx.array(rows, dtype=mx.int32)
            homes = mx.array([self.state_home[i] for i in rows], dtype=mx.int32)
            for layer, arrays in enumerate(self.state):
                self.states.write(layer, homes, [a[row_idx] for a in arrays])
        self.flushed = self.idx

    def _unflushed(self, buffer: mx.array, row_idx: mx.array) -> mx.array:
        """`buffer`'s unflushed columns of rows `row_idx` as (rows x columns, H, width)."""
        # slice, then pick rows: `x[row_idx, :, a:b]` gathers whole rows first
        x = buffer[:, :, self.flushed : self.idx, :][row_idx]
        return x.transpose(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[3])

    def arrays(self) -> list[mx.array]:
        parts = [a for layer in self.parts for a in layer]
        return self.keys + self.values + parts + [a for layer in self.state for a in layer]

    def _gather_states(self, slots: list[int]) -> list[list[mx.array]]:
        if self.states is None:
            return []
        idx = mx.array(slots, dtype=mx.int32)
        return [self.states.gather(layer, idx) for layer in range(self.states.layout.num_layers)]

    def _fill_states(self, rows: list[int], homes: list[int]) -> None:
        """Joining rows' states from their working slots."""
        joined = self._gather_states(homes)
        at = mx.array(rows, dtype=mx.int32)
        self._state_before = None  # written in place below: no step to take back
        for layer, arrays in enumerate(self.state):
            for i, a in enumerate(arrays):
                a[at] = joined[layer][i]
        for row, home in zip(rows, homes):
            self.state_home[row] = home

    # ------------------------------------------------------------ columns

    def _fill(self, rows: list[int], slots: list[list[int]]) -> None:
        """Joining requests' KV from the pool into `rows`, one whole row at a time: a row of
        the buffer's full width is a size MLX's buffer cache has seen before, where a
        gather sized by the current column needed fresh, page-faulted memory each time (6%
        more shared-prefix throughput), and a slice update per row is 7x faster than a
        row scatter, which copied the whole buffer."""
        cap = self.keys[0].shape[2]
        for row, row_slots in zip(rows, slots):
            keys, values, parts = self._gather([row_slots], self.idx, cap)
            at = mx.array([row], dtype=mx.int32)
            for layer in range(len(self.keys)):
                self.keys[layer] = mx.slice_update(self.keys[layer], keys[layer], at, (0,))
                self.values[layer] = mx.slice_update(self.values[layer], values[layer], at, (0,))
                for i, part in enumerate(parts[layer] if parts else ()):
                    self.parts[layer][i] = mx.slice_update(self.parts[layer][i], part, at, (0,))

    def _gather(
        self, slots: list[list[int]], T: int, cap: int
    ) -> tuple[list[mx.array], list[mx.array], list[list[mx.array]]]:
        """Per layer, (len(slots), H, cap, D) rows of pool KV ending just before column T,
        and over a quantized pool the stored parts of the same columns (else [])."""
        idx = self.pool.head_index(
            mx.array([[0] * (T - len(s)) + s + [0] * (cap - T) for s in slots])
        )
        layers = range(self.pool.layout.num_layers)
        if not self.pool.codec.quantized:
            pairs = [self.pool.gather_heads(layer, idx) for layer in layers]
            return [k for k, _ in pairs], [v for _, v in pairs], []
        parts = [self.pool.gather_parts(layer, idx) for layer in layers]
        pairs = [self.pool.decode(p) for p in parts]
        return [k for k, _ in pairs], [v for _, v in pairs], parts

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
        cap = self.keys[0].shape[2]
        if self.idx + columns > cap:
            self._recolumn(0, cap, 2 * cap)

    def _recolumn(self, start: int, width: int, cap: int) -> None:
        """Every buffer becomes its columns [start, start + width), zero-padded to `cap`."""
        for i in range(len(self.keys)):
            self.keys[i] = _shifted(self.keys[i], start, width, cap)
            self.values[i] = _shifted(self.values[i], start, width, cap)
            for p, part in enumerate(self.parts[i] if self.parts else ()):
                self.parts[i][p] = _shifted(part, start, width, cap)
        pad = mx.zeros((len(self.rids), cap - width), dtype=mx.bool_)
        self.holes = mx.concatenate([self.holes[:, start : start + width], pad], axis=1)


def _shifted(buffer: mx.array, start: int, width: int, cap: int) -> mx.array:
    """Columns [start, start + width) of `buffer`, zero-padded to `cap` columns."""
    B, H, _, D = buffer.shape
    pad = mx.zeros((B, H, cap - width, D), dtype=buffer.dtype)
    return mx.concatenate([buffer[:, :, start : start + width], pad], axis=2)


def _round_up(n: int, step: int) -> int:
    return (n + step - 1) // step * step
