"""Float32 linear layers for a few rows (a decode step) as OpenBLAS's small-matrix kernel.

A decode step's matmuls are a few rows times a weight matrix, which the step reads once:
the work is memory traffic. OpenBLAS (0.3.21, SkylakeX/Cooperlake kernel sets) gives an
sgemm of M * N * K above 100^3 to its blocked path, which first copies (packs) the weight
into a buffer and runs two threads that spin in sched_yield while they wait: in a batch-8
step of the medium preset the packing copy alone took 27% of the step's samples (perf).
Below that size it runs its small-matrix kernel, which reads the operands where they are,
on one thread. So a layer whose rows are few is computed as a batch of row blocks of its
weight, each block small enough for that kernel: (N/c, c, K) @ (K, M), a view of the same
weight (no copy), and the (N, M) result transposed back.

`install(model)` gives every plain float32 nn.Linear of the model this forward (a subclass
with the same parameters, so LoRA wrapping and weight loading see the same module); a
prefill's many rows keep the stock matmul.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from worker_mlx.backends import cpu_split

# OpenBLAS's small-matrix kernels take an sgemm of at most this many multiply-adds
# (sgemm_small_kernel_permit: M * N * K <= 100^3)
SMALL_MNK = 100**3
# Rows past which the blocked sgemm is left alone (a prefill, a long verify step)
MAX_ROWS = 16
# Fewer weight rows per block than this and the calls' overhead outweighs the packing saved
MIN_BLOCK = 16
# Weights smaller than this (4 MiB of float32) stay in the caches from step to step, where
# the blocked sgemm's two threads win: the small preset's 0.75 MiB MLP weights in blocks
# made its batch-8 step 1.5x slower, the medium preset's 4-12 MiB ones 2x faster.
MIN_WEIGHT = 1 << 20


def block_rows(rows: int, n: int, k: int) -> int | None:
    """Weight rows per block for `rows` input rows of an (n, k) weight: the largest divisor
    of n that keeps a block's sgemm small; None where the stock matmul is the better one."""
    if rows > MAX_ROWS or rows * n * k <= SMALL_MNK or n * k < MIN_WEIGHT:
        return None
    most = SMALL_MNK // (rows * k)
    return max((d for d in range(MIN_BLOCK, min(most, n) + 1) if n % d == 0), default=None)


def small_rows_matmul(x: mx.array, weight: mx.array) -> mx.array | None:
    """x @ weight.T as blocks of the weight's rows, or None where it does not pay."""
    *lead, k = x.shape
    n, rows = weight.shape[0], math.prod(lead)
    if weight.dtype != mx.float32 or x.dtype != mx.float32:
        return None
    block = block_rows(rows, n, k)
    if block is None:
        return None
    blocks = weight.reshape(n // block, block, k)
    # x as a batch of one: a 2-D right operand lets mlx fold the blocks back into one
    # (n, k) sgemm, the blocked path again
    x_t = x.reshape(rows, k).T[None]
    # (n / block, block, rows), half of the blocks on each of two threads (cpu_split)
    out = cpu_split.halves(lambda part: blocks[part] @ x_t, n // block, weight.nbytes)
    return out.reshape(n, rows).T.reshape(*lead, n)


class SmallRowsLinear(nn.Linear):
    """nn.Linear whose few-row calls run as `small_rows_matmul`."""

    def __call__(self, x: mx.array) -> mx.array:
        out = small_rows_matmul(x, self["weight"])
        if out is None:
            return super().__call__(x)
        return out + self["bias"] if "bias" in self else out


def install(model: nn.Module) -> list[nn.Module]:
    """Make every plain float32 nn.Linear of `model` a SmallRowsLinear; returns them."""
    swapped = [
        m
        for _, m in model.named_modules()
        if type(m) is nn.Linear and m["weight"].dtype == mx.float32
    ]
    for m in swapped:
        m.__class__ = SmallRowsLinear
    return swapped


def uninstall(swapped: list[nn.Module]) -> None:
    for m in swapped:
        m.__class__ = nn.Linear


def agrees_with_stock(atol: float = 1e-4) -> bool:
    """Blocks of rows compute what the stock matmul does, to float32 rounding."""
    k0, k1 = mx.random.split(mx.random.key(2))
    w = mx.random.normal((512, 2048), key=k0) / 45
    x = mx.random.normal((2, 4, 2048), key=k1)
    out = small_rows_matmul(x, w)
    return out is not None and mx.allclose(out, x @ w.T, rtol=1e-4, atol=atol).item()
