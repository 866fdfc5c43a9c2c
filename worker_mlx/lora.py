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

Adapters load and unload while the worker serves (`LoraBank.load` / `unload`, between
steps): the stacks are rebuilt, rows in id order, and the layers a new adapter adapts are
wrapped then.
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
    """The bank of a runner that serves no adapters (a draft model's, a distributed
    worker's): the same calls, doing nothing."""

    count = 0
    nbytes = 0

    @contextmanager
    def rows_of(self, adapters: Sequence[int]) -> Iterator[None]:
        yield

    @contextmanager
    def bound(self, rows: mx.array | None) -> Iterator[None]:
        yield

    @property
    def rows(self) -> None:
        return None

    def load(self, lora: int, spec: LoraSpec) -> None:
        raise ValueError(_NONE_HERE)

    def unload(self, lora: int) -> None:
        raise ValueError(_NONE_HERE)


_NONE_HERE = "this worker serves no LoRA adapters (--speculative-algorithm, --tp-size or --pp-size)"


NO_LORA = NoLora()  # stateless: one serves every runner without adapters


class LoraBank:
    """The adapters' stacked factors per adapted layer (row 0: none) and the current
    pass's per-row stack rows, which the wrapped layers read. Adapters are known by their
    ids (the requests'); each has a row of the stacks, which a load or an unload
    rebuilds (between steps: the runner traces its compiled step afresh)."""

    def __init__(self, model: nn.Module, specs: list[LoraSpec]):
        self.model = model
        self.adapters: dict[int, tuple[str, float, dict]] = {}  # id -> (name, scale, factors)
        self.row_of: dict[int, int] = {}  # id -> its row of the stacks
        self.rows: mx.array | None = None
        self.scales = mx.zeros((1,), dtype=mx.float32)
        self.stacks: dict[str, tuple[mx.array, mx.array]] = {}
        for i, spec in enumerate(specs):
            self.adapters[i + 1] = (spec.name, *_read(spec))
        self._restack()

    @property
    def count(self) -> int:
        return len(self.adapters)

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.adapters.values()]

    @property
    def nbytes(self) -> int:
        """What its stacks hold."""
        return self.scales.nbytes + sum(a.nbytes + b.nbytes for a, b in self.stacks.values())

    def load(self, lora: int, spec: LoraSpec) -> None:
        """Serve the adapter at `spec.path` as id `lora` (ValueError: it cannot apply)."""
        if lora in self.adapters:
            raise ValueError(f"LoRA adapter id {lora} is in use")
        self.adapters[lora] = (spec.name, *_read(spec))
        try:
            self._restack()
        except ValueError:
            del self.adapters[lora]
            self._restack()
            raise

    def unload(self, lora: int) -> None:
        if self.adapters.pop(lora, None) is None:
            raise ValueError(f"no LoRA adapter of id {lora} is loaded")
        self._restack()

    def _restack(self) -> None:
        """The stacks of every adapted layer, rows in id order; layers an adapter adapts
        for the first time are wrapped (a layer stays wrapped: with no row of it, it adds
        nothing)."""
        loaded = list(self.adapters.values())
        self.row_of = {lora: i + 1 for i, lora in enumerate(self.adapters)}
        self.scales = mx.array([0.0] + [scale for _, scale, _ in loaded], dtype=mx.float32)
        modules = dict(self.model.named_modules())
        targets = sorted({m for _, _, factors in loaded for m in factors} | set(self.stacks))
        stacks, wrapped = {}, []
        for target in targets:
            layer = modules.get(target)
            if target not in self.stacks and not isinstance(layer, _LINEAR):
                raise ValueError(f"{target} is not a linear layer of this model")
            base = layer if target not in self.stacks else layer.base
            stacks[target] = _stack([f.get(target) for _, _, f in loaded], base, _dtype(loaded))
            if target not in self.stacks:
                wrapped.append((target, LoraLinear(layer, self, target)))
        self.stacks = stacks
        if wrapped:
            self.model.update_modules(tree_unflatten(wrapped))
        mx.eval(self.scales, list(self.stacks.values()))

    @contextmanager
    def bound(self, rows: mx.array | None) -> Iterator[None]:
        """The layers read `rows` (an int32 array, one stack row per row of the pass, or
        None: no row has an adapter) until the block ends."""
        before, self.rows = self.rows, rows
        try:
            yield
        finally:
            self.rows = before

    @contextmanager
    def rows_of(self, adapters: Sequence[int]) -> Iterator[None]:
        """A forward pass whose row i runs adapter id `adapters[i]` (0: none). A row of an
        unloaded adapter runs none: a finished request's row not released yet (the
        lookahead's bet), whose tokens nobody reads."""
        rows = None
        if any(adapters):
            rows = mx.array([self.row_of.get(a, 0) for a in adapters], dtype=mx.int32)
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


_LINEAR = (nn.Linear, nn.QuantizedLinear)


def _read(spec: LoraSpec) -> tuple[float, dict[str, tuple[mx.array, mx.array]]]:
    """(scale, module path -> (lora_a, lora_b)) of the adapter at `spec.path`."""
    root = Path(spec.path)
    config = json.loads((root / ADAPTER_CONFIG).read_text())
    weights = mx.load(str(root / ADAPTER_WEIGHTS))
    modules = {name.rpartition(".")[0] for name in weights}
    factors = {m: (weights[f"{m}.lora_a"], weights[f"{m}.lora_b"]) for m in modules}
    return float(config["lora_parameters"]["scale"]), factors


def _dtype(loaded: list) -> mx.Dtype:
    """mlx-lm computes the update in the adapter's stored dtype (x is promoted to it)."""
    for _, _, factors in loaded:
        return next(iter(factors.values()))[0].dtype
    return mx.float32


def _widths(base: nn.Module) -> tuple[int, int]:
    """(in, out) of a linear layer (a quantized one's input width from its packing)."""
    out_dims, in_dims = base.weight.shape
    if isinstance(base, nn.QuantizedLinear):
        in_dims = in_dims * 32 // base.bits
    return in_dims, out_dims


def _stack(factors: list[tuple[mx.array, mx.array] | None], base: nn.Module, dtype) -> tuple:
    """A (n + 1, in, r) and B (n + 1, r, out) of one layer: row 0 and the adapters that
    leave it alone are zeros, smaller ranks padded with zeros (they add exact zeros).
    ValueError for factors of other widths than the layer's."""
    in_dims, out_dims = _widths(base)
    present = [f for f in factors if f is not None]
    rank = max((a.shape[1] for a, _ in present), default=1)
    a_rows, b_rows = [mx.zeros((in_dims, rank), dtype)], [mx.zeros((rank, out_dims), dtype)]
    for f in factors:
        a, b = f if f is not None else (mx.zeros((in_dims, 0)), mx.zeros((0, out_dims)))
        if a.shape[0] != in_dims or b.shape[1] != out_dims:
            raise ValueError(
                f"factors {a.shape[0]} -> {b.shape[1]} for a layer of {in_dims} -> {out_dims}"
            )
        pad = rank - a.shape[1]
        a_rows.append(mx.pad(a.astype(dtype), [(0, 0), (0, pad)]))
        b_rows.append(mx.pad(b.astype(dtype), [(0, pad), (0, 0)]))
    return mx.stack(a_rows), mx.stack(b_rows)


def make_bank(model: nn.Module, specs: list[LoraSpec], runtime: bool = False):
    """The model's adapters, its layers wrapped (LoraBank); with none and not `runtime`
    (adapters loaded while it serves), NoLora and the model untouched."""
    return LoraBank(model, specs) if specs or runtime else NO_LORA
