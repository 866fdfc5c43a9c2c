"""LoRA adapters per request, batched: every row of a step runs its own adapter.

The punica / S-LoRA idea: the weights are never merged. Per adapted linear layer the
adapters' low-rank factors are stacked, `A` (n + 1, in, r) and `B` (n + 1, r, out), with
index 0 all zeros (the base model) and ranks below the largest padded with zeros, and the
layer computes

    y = base(x) + scale[i] * ((x @ A[i]) @ B[i])      for each row with adapter index i,

gathering each row's factors (`mx.gather_mm`), so rows of different adapters and rows of none
share one forward pass. This is mlx-lm's `LoRALinear` per row (the same float32
operations in the same order), so a row's tokens are what `mlx_lm.load(path,
adapter_path=...)` generates.

The runner tells the layers the rows' adapters once per forward pass (`LoraBank.rows_of`);
a pass of base rows only skips the low-rank work (`rows` is None). The compiled decode
step takes the rows as an argument of its traced function and binds them there
(`LoraBank.bound`), since a compiled graph holds its captured arrays as constants.
`NoLora` is the bank of a server without adapters: the same calls, doing nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from common.lora_adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraSpec


class NoLora:
    """The bank of a runner without adapters."""

    count = 0

    @contextmanager
    def rows_of(self, adapters: Sequence[int]) -> Iterator[None]:
        yield

    @contextmanager
    def bound(self, rows: mx.array | None) -> Iterator[None]:
        yield

    @property
    def rows(self) -> None:
        return None


NO_LORA = NoLora()  # stateless: one serves every runner without adapters


class LoraBank:
    """The adapters' stacked factors per adapted layer (index 0: none) and the current
    pass's per-row adapter indices, which the wrapped layers read."""

    def __init__(self, model: nn.Module, specs: list[LoraSpec]):
        self.names = [s.name for s in specs]
        self.count = len(specs)
        self.rows: mx.array | None = None
        loaded = [_read(spec) for spec in specs]  # [(scale, {module: (a, b)})]
        # mlx-lm computes the update in the adapter's stored dtype (x is promoted to it)
        dtype = loaded[0][1][next(iter(loaded[0][1]))][0].dtype
        self.scales = mx.array([0.0] + [scale for scale, _ in loaded], dtype=mx.float32)
        modules = dict(model.named_modules())
        targets = sorted({m for _, factors in loaded for m in factors})
        self.stacks: dict[str, tuple[mx.array, mx.array]] = {}
        wrapped = []
        for target in targets:
            base = modules.get(target)
            if not isinstance(base, (nn.Linear, nn.QuantizedLinear)):
                raise ValueError(f"{target} is not a linear layer of this model")
            self.stacks[target] = _stack([f.get(target) for _, f in loaded], dtype)
            wrapped.append((target, LoraLinear(base, self, target)))
        model.update_modules(tree_unflatten(wrapped))
        mx.eval(self.scales, list(self.stacks.values()))

    @contextmanager
    def bound(self, rows: mx.array | None) -> Iterator[None]:
        """The layers read `rows` (an int32 array, one adapter index per row of the pass,
        or None: no row has an adapter) until the block ends."""
        before, self.rows = self.rows, rows
        try:
            yield
        finally:
            self.rows = before

    @contextmanager
    def rows_of(self, adapters: Sequence[int]) -> Iterator[None]:
        """A forward pass whose row i runs adapter `adapters[i]` (0: none)."""
        rows = mx.array(list(adapters), dtype=mx.int32) if any(adapters) else None
        with self.bound(rows):
            yield


class LoraLinear(nn.Module):
    """A base linear layer plus each row's adapter update (see the module docstring)."""

    def __init__(self, base: nn.Module, bank: LoraBank, target: str):
        super().__init__()
        self.base = base
        self._bank, self._target = bank, target  # not parameters: plain attributes

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        rows = self._bank.rows
        if rows is None:
            return y
        a, b = self._bank.stacks[self._target]
        # (B, L, in) @ A[rows] @ B[rows] without copying the rows' factors out: on the CPU
        # 12x faster than indexing then matmul at batch 8, and the same values
        z = mx.gather_mm(mx.gather_mm(x, a, rhs_indices=rows), b, rhs_indices=rows)
        scale = self._bank.scales[rows].reshape(-1, *([1] * (z.ndim - 1)))
        return y + (scale * z).astype(x.dtype)


def _read(spec: LoraSpec) -> tuple[float, dict[str, tuple[mx.array, mx.array]]]:
    """(scale, module path -> (lora_a, lora_b)) of the adapter at `spec.path`."""
    root = Path(spec.path)
    config = json.loads((root / ADAPTER_CONFIG).read_text())
    weights = mx.load(str(root / ADAPTER_WEIGHTS))
    modules = {name.rpartition(".")[0] for name in weights}
    factors = {m: (weights[f"{m}.lora_a"], weights[f"{m}.lora_b"]) for m in modules}
    return float(config["lora_parameters"]["scale"]), factors


def _stack(factors: list[tuple[mx.array, mx.array] | None], dtype) -> tuple[mx.array, mx.array]:
    """A (n + 1, in, r) and B (n + 1, r, out) of one layer: index 0 and the adapters that
    leave it alone are zeros, smaller ranks padded with zeros (they add exact zeros)."""
    present = [f for f in factors if f is not None]
    in_dims, out_dims = present[0][0].shape[0], present[0][1].shape[1]
    rank = max(a.shape[1] for a, _ in present)
    a_rows, b_rows = [mx.zeros((in_dims, rank), dtype)], [mx.zeros((rank, out_dims), dtype)]
    for f in factors:
        a, b = f if f is not None else (mx.zeros((in_dims, 0)), mx.zeros((0, out_dims)))
        pad = rank - a.shape[1]
        a_rows.append(mx.pad(a.astype(dtype), [(0, 0), (0, pad)]))
        b_rows.append(mx.pad(b.astype(dtype), [(0, pad), (0, 0)]))
    return mx.stack(a_rows), mx.stack(b_rows)


def make_bank(model: nn.Module, specs: list[LoraSpec]) -> LoraBank | NoLora:
    """The model's adapters, its layers wrapped; NoLora (and the model untouched) if none."""
    return LoraBank(model, specs) if specs else NO_LORA
