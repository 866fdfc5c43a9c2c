"""Where a batch decode step's time goes: its weight matmuls and its attention, timed apart.

    python -m benchmarks.decode_split --preset medium --batch-size 8 --context 1024 8192

A preset's shapes with random float32 weights and K/V, each part compiled and evaluated
alone (mx.eval barriers), best and median of --repeats:

- weights: every linear layer of every decoder layer at `batch-size` rows, once as the
  stock `x @ W.T` and once as the CPU backend runs it (worker_mlx/backends/cpu_linear.py,
  its big products in halves on two CPU streams: cpu_split);
- attention, per context: each layer writes one column into its (B, Hk, capacity, D)
  K/V buffers and attends over the written columns rounded up as the compiled step does
  (decode_step.attention_width), through the CPU kernels' attention (cpu_kernels.py),
  once whole and once in halves on two CPU streams (cpu_split; with two threads), the
  one the backend takes at that size marked: where `cpu_split.MIN_ATTENTION_BYTES`
  should sit on this machine.

GB/s are the bytes read (weights, or K/V up to the context) per second; set them beside
`python -m benchmarks.bandwidth`. What is left of `benchmarks.decode_floor`'s step is
the rest (norms, RoPE, the head, sampling, the step's own overhead).
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager

from common.tiny_presets import PRESETS
from worker_mlx.backends.blas import preload_openblas

BLAS = preload_openblas()

import mlx.core as mx  # noqa: E402

from benchmarks.bandwidth import timed  # noqa: E402
from worker_mlx.backends import cpu_kernels, cpu_split  # noqa: E402
from worker_mlx.backends.cpu_linear import small_rows_matmul  # noqa: E402
from worker_mlx.decode_step import attention_width  # noqa: E402


def weight_shapes(p: dict) -> list[tuple[int, int]]:
    q, kv = p["heads"] * p["head_dim"], p["kv_heads"] * p["head_dim"]
    h, i = p["hidden"], p["intermediate"]
    return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)] * p["layers"]


def weights(p: dict, rows: int, repeats: int) -> None:
    ws = [mx.random.normal(s) for s in weight_shapes(p)]
    xs = {w.shape[1]: mx.random.normal((rows, w.shape[1])) for w in ws}
    mx.eval(ws, list(xs.values()))
    nbytes = sum(w.nbytes for w in ws)
    ways = {
        "stock x @ W.T": mx.compile(lambda x, w: x @ w.T),
        "CPU backend": mx.compile(lambda x, w: _or_stock(small_rows_matmul(x, w), x, w)),
    }
    for name, f in ways.items():
        best, med = timed(lambda f=f: mx.eval([f(xs[w.shape[1]], w) for w in ws]), repeats)
        print(f"weights, {name:>14}: best {best * 1e3:7.1f} ms, median {med * 1e3:7.1f} ms,"
              f" {nbytes / best / 1e9:5.1f} GB/s of {nbytes / 1e6:.0f} MB")  # fmt: skip


def _or_stock(out, x, w):
    return x @ w.T if out is None else out


def attention(p: dict, rows: int, context: int, repeats: int) -> None:
    hk, d, layers, rep = p["kv_heads"], p["head_dim"], p["layers"], p["heads"] // p["kv_heads"]
    cap = (context + 256) // 256 * 256  # the decode buffer grows in steps of 256
    width, _ = attention_width(context, cap)
    keys = [mx.random.normal((rows, hk, cap, d)) for _ in range(layers)]
    values = [mx.random.normal((rows, hk, cap, d)) for _ in range(layers)]
    q, new = mx.random.normal((rows, hk * rep, 1, d)), mx.random.normal((rows, hk, 1, d))
    mask = mx.arange(width)[None, None, None] <= context
    mx.eval(keys, values, q, new, mask)

    def step(at, keys, values):
        keys = [mx.slice_update(k, new, at, axes=(2,)) for k in keys]
        values = [mx.slice_update(v, new, at, axes=(2,)) for v in values]
        outs = [
            cpu_kernels.scaled_dot_product_attention(
                q, k[:, :, :width], v[:, :, :width], None, d**-0.5, mask
            )
            for k, v in zip(keys, values)
        ]
        return outs, keys, values

    at, state = mx.array([context], mx.int32), [keys, values]
    nbytes = 2 * layers * rows * hk * context * d * 4
    layer = keys[0][:, :, :width].nbytes * 2  # what the split's size is compared with
    split = cpu_split.second_stream(layer, cpu_split.MIN_ATTENTION_BYTES) is not None
    taken = "in halves" if split else "whole"
    ways = {"whole": 1 << 62}
    if cpu_split.second_stream(1 << 62) is not None:  # two threads: the stream is there
        ways["in halves"] = 0
    for way, size in ways.items():
        with _attention_split_from(size):
            compiled = mx.compile(step)  # whole or halves is decided when it is traced

            def run(compiled=compiled):
                outs, state[0], state[1] = compiled(at, *state)
                mx.eval(outs, state)

            best, med = timed(run, repeats)
        mark = " (the backend's)" if way == taken else ""
        print(f"attention at {context:>6} tokens (width {width}, {layer / 2**20:.1f} MiB a"
              f" layer), {way + mark:>26}: best {best * 1e3:7.1f} ms, median {med * 1e3:7.1f}"
              f" ms, {nbytes / best / 1e9:5.1f} GB/s of {nbytes / 1e6:.0f} MB")  # fmt: skip


@contextmanager
def _attention_split_from(nbytes: int):
    """The one-query attention split between the streams from `nbytes` of K/V a layer."""
    before, cpu_split.MIN_ATTENTION_BYTES = cpu_split.MIN_ATTENTION_BYTES, nbytes
    try:
        yield
    finally:
        cpu_split.MIN_ATTENTION_BYTES = before


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="medium", choices=sorted(PRESETS))
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--context", type=int, nargs="+", default=[1024])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    mx.set_cache_limit(1 << 30)
    undo = cpu_split.install()  # the second stream, as the worker makes it (two threads)
    print(f"{args.preset}, batch {args.batch_size}, BLAS: {BLAS}")
    p = PRESETS[args.preset]
    try:
        weights(p, args.batch_size, args.repeats)
        for context in args.context:
            attention(p, args.batch_size, context, args.repeats)
    finally:
        undo()


if __name__ == "__main__":
    main()
