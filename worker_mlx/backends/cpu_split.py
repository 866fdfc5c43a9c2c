"""A step's big work in two halves, so both cores work: a decode step's big reads on two
CPU streams, a prefill's numpy work on two threads.

A decode step reads every weight once and each row's K/V once, and on the CPU each of
those products runs on one thread: the few-row linear layers as OpenBLAS's small-matrix
kernel (cpu_linear), the one-query attention as one small product per head (cpu_kernels).
One core reads at about half the machine's bandwidth, so the step took about twice its
memory floor (docs/performance.md, issue 32). MLX runs each stream's work on a thread of
its own: a second CPU stream takes half of each big product (half of a weight's row
blocks, half of the rows' attention), the step's default stream the other half, and the
halves join in one concatenation. Each half is the same product as before, so the result
is bit-identical.

A prefill's numpy work (the attention's softmax and SwiGLU, cpu_kernels) runs on the
calling thread while the step's compute threads wait for it: `host_halves` gives half of
its rows to a helper thread (numpy releases the GIL in its loops), the same per-row
arithmetic, so bit-identical too.

Only products that read at least MIN_BYTES are split (a layer's one-query attention, at
least MIN_ATTENTION_BYTES): smaller ones stay in the caches from step to step, where the
second stream's hand-offs cost more than they save. `install` makes the stream when the
process may use two threads (OPENBLAS_NUM_THREADS, which a distributed worker's ranks on
one host share out, else the cores it may run on).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

from worker_mlx.backends.blas import cores

# Bytes a weight product must read before it is split: the medium preset's weights
# (4-12 MiB) are, the small preset's (at most 0.75 MiB) are not.
MIN_BYTES = 4 << 20
# A layer's one-query attention (all rows' K/V) before it is split: below it, halves made
# the in-process step at most ~3% faster (8-13 MiB a layer), and over HTTP they waited on
# the core the router and scheduler use (the small preset at 1k tokens, 9 MiB: shared-
# prefix ITL p50 1.12x, output 0.92x); from 16 MiB alone 0.56-0.8x (docs/performance.md,
# issue 32). At batch 8: the small preset's K/V past 2k tokens, the medium preset's 256.
MIN_ATTENTION_BYTES = 16 << 20

_made: mx.Stream | None = None  # made once: each stream is a thread for the process's life
_second: mx.Stream | None = None  # _made while installed
# Elements numpy's work must cover before it is split: a batch-8 prefill of 256-token
# prompts is split (its prefill 0.89x), one 64-token question over 1,024 cached tokens
# (0.28M scores) was no faster in halves, the hand-off costing what the half saved
MIN_HOST_ELEMENTS = 1 << 20
_helper: ThreadPoolExecutor | None = None  # made on first use: one thread, for life


def threads() -> int:
    """The threads this process may compute on: OPENBLAS_NUM_THREADS if set, else its cores."""
    given = os.environ.get("OPENBLAS_NUM_THREADS", "")
    return int(given) if given.isdigit() and int(given) > 0 else cores()


def install() -> Callable[[], None]:
    """Make the second stream if this process has two threads to compute on; the undo
    turns the splitting off (the stream itself lives as long as the process)."""
    global _made, _second
    if threads() >= 2:
        _made = _made or mx.new_stream(mx.cpu)
        _second = _made

    def undo() -> None:
        global _second
        _second = None

    return undo


def second_stream(nbytes: int, min_bytes: int | None = None) -> mx.Stream | None:
    """The stream for the second half of a product reading `nbytes`, or None: unsplit
    (below `min_bytes`, by default MIN_BYTES)."""
    return _second if nbytes >= (MIN_BYTES if min_bytes is None else min_bytes) else None


def halves(
    compute: Callable[[slice], mx.array], n: int, nbytes: int, min_bytes: int | None = None
) -> mx.array:
    """compute(slice(0, n)), as compute of the first half on the current stream and of
    the second on the second stream, joined along the first axis; whole where not split."""
    stream = second_stream(nbytes, min_bytes) if n >= 2 else None
    if stream is None:
        return compute(slice(0, n))
    h = n // 2
    first = compute(slice(0, h))
    with mx.stream(stream):
        rest = compute(slice(h, n))
    return mx.concatenate([first, rest])


def host_halves(compute: Callable[..., None], *arrays: np.ndarray | None) -> None:
    """compute(*arrays), host (numpy) work in place, as two calls on halves of the rows of
    arrays[0], split along its first axis before the last with more than one entry; the
    other arrays (broadcasting against it, aligned from the right; None for absent ones)
    are cut along with it where they have that axis. The second half runs on a helper
    thread while this one computes the first; whole where not split."""
    global _helper
    ref = arrays[0]
    axis = next((a for a in range(ref.ndim - 1) if ref.shape[a] > 1), 0)
    n = ref.shape[axis]
    if _second is None or n < 2 or ref.size < MIN_HOST_ELEMENTS:
        compute(*arrays)
        return

    def rows(part: slice) -> None:
        compute(*(_share(a, ref.ndim, axis, part) for a in arrays))

    _helper = _helper or ThreadPoolExecutor(1, thread_name_prefix="host-half")
    h = n // 2
    rest = _helper.submit(rows, slice(h, n))
    rows(slice(0, h))
    rest.result()


def _share(a: np.ndarray | None, ndim: int, axis: int, part: slice) -> np.ndarray | None:
    """`a`'s entries for `part` of `axis` of an ndim-dim array it broadcasts against
    (aligned from the right); all of it where it has no such axis or broadcasts along it."""
    if a is None:
        return None
    ax = axis - (ndim - a.ndim)
    if ax < 0 or a.shape[ax] == 1:
        return a
    return a[(slice(None),) * ax + (part,)]
