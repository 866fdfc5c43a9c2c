"""StatePool: the recurrent layers' states (conv and SSM / gated-delta) by state slot.

A recurrent layer (mlx-lm's `ArraysCache`) keeps no KV per token: its whole history is a
few fixed-size arrays per request. Like the KV pool, the worker owns the data and the
scheduler the slot ids (`ExtendReq.state_slot`, `prefix_state`, `snapshots`,
`ReleaseReq.snapshot`): a running request works in its own slot, and the trie's snapshots
are copies of it taken where the scheduler asked. Slot 0 is the zero state, never written.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

# Past this many slots the scheduler gains nothing (a slot per running request and a
# snapshot per cached conversation turn) and a real model's state is megabytes a slot.
MAX_STATE_SLOTS = 4096


@dataclass(frozen=True)
class StateLayout:
    """Per recurrent layer, the shape (without the batch axis) and dtype of each array
    its cache holds, probed from the model."""

    entries: tuple[tuple[tuple[tuple[int, ...], mx.Dtype], ...], ...]

    @property
    def num_layers(self) -> int:
        return len(self.entries)

    @property
    def bytes_per_slot(self) -> int:
        total = 0
        for layer in self.entries:
            for shape, dtype in layer:
                n = dtype.size
                for d in shape:
                    n *= d
                total += n
        return total


class StatePool:
    def __init__(self, layout: StateLayout, num_slots: int):
        self.layout = layout
        self.num_slots = num_slots
        self.arrays = [
            [mx.zeros((num_slots + 1, *shape), dtype) for shape, dtype in layer]
            for layer in layout.entries
        ]
        mx.eval(self.arrays)

    def gather(self, layer: int, slots: mx.array) -> list[mx.array]:
        """The arrays of `slots` (B,) of one layer, each (B, ...)."""
        return [a[slots] for a in self.arrays[layer]]

    def write(self, layer: int, slots: mx.array, values: list[mx.array]) -> None:
        """Store (B, ...) arrays at `slots` (B,), never slot 0 (the zero state)."""
        for a, v in zip(self.arrays[layer], values):
            a[slots] = v.astype(a.dtype)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Every layer's state of slot `src` into slot `dst`, for each (src, dst) pair
        (snapshots)."""
        if not pairs:
            return
        s = mx.array([a for a, _ in pairs], dtype=mx.int32)
        d = mx.array([b for _, b in pairs], dtype=mx.int32)
        for layer in self.arrays:
            for a in layer:
                a[d] = a[s]

    def all(self) -> list[mx.array]:
        return [a for layer in self.arrays for a in layer]


class NoStates:
    """The state pool of a model without recurrent layers, composed once in its place:
    no slots, nothing to hold or copy."""

    num_slots = 0

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        pass

    def all(self) -> list[mx.array]:
        return []


def state_slots(layout: StateLayout, budget_bytes: int | None, max_running: int) -> int:
    """How many state slots: room for every running request and as many snapshots again
    three times over, within a sixteenth of the memory budget when one is known."""
    want = min(MAX_STATE_SLOTS, 4 * max_running + 64)
    if budget_bytes is not None:
        want = min(want, max(budget_bytes // 16 // layout.bytes_per_slot, 2 * max_running))
    return max(want, 2)
