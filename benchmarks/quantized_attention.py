"""One decode attention over a quantized KV cache, three ways, alternating in one run.

    python -m benchmarks.quantized_attention [--batch-size 8] [--context 2048] [--bits 8]

(1) float K/V and two matmuls (what the worker's decode step runs over its decode buffer,
which holds K/V decoded), (2) `mx.quantized_matmul` on the packed K/V (mlx-lm's quantized
SDPA), (3) decoding the packed K/V first (`kv_codec.QuantizedCodec.decode`), then (1). The
small preset's shapes: 2 KV heads, 2 query heads each, head dim 64. Prints each one's
median time per layer and its ratio to (1); on Metal (2) is what saves bandwidth, on the
CPU this tells whether it pays.
"""

from __future__ import annotations

import argparse
import statistics
import time

from worker_mlx.backends.blas import preload_openblas

BLAS = preload_openblas()

import mlx.core as mx  # noqa: E402

from worker_mlx.kv_codec import QuantizedCodec  # noqa: E402


def kernels(B: int, S: int, bits: int, Hk: int = 2, rep: int = 2, D: int = 64) -> dict:
    keys = mx.random.split(mx.random.key(0), 3)
    k = mx.random.normal((B, Hk, S, D), key=keys[0])
    v = mx.random.normal((B, Hk, S, D), key=keys[1])
    q = mx.random.normal((B, Hk, rep, D), key=keys[2])
    codec = QuantizedCodec(mx.float32, bits)
    qk, qv = codec.encode(k), codec.encode(v)
    mx.eval(k, v, q, qk, qv)

    def float_matmuls(k=k, v=v):
        return mx.softmax(q @ k.swapaxes(-1, -2), axis=-1) @ v

    def quantized_matmuls():
        s = mx.quantized_matmul(q, *qk, transpose=True, group_size=64, bits=bits)
        w = mx.softmax(s, axis=-1)
        return mx.quantized_matmul(w, *qv, transpose=False, group_size=64, bits=bits)

    def decode_then_float():
        return float_matmuls(codec.decode(qk), codec.decode(qv))

    return {
        "float matmuls": float_matmuls,
        "mx.quantized_matmul": quantized_matmuls,
        "decode, then float matmuls": decode_then_float,
    }


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--bits", type=int, default=8, choices=[4, 8])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    fns = kernels(args.batch_size, args.context, args.bits)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        mx.eval(fn())  # warm up
    for _ in range(args.rounds):  # alternate, so load on the machine hits all alike
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(args.iters):
                mx.eval(fn())
            times[name].append((time.perf_counter() - t) / args.iters)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    base = med["float matmuls"]
    print(f"batch {args.batch_size}, context {args.context}, int{args.bits}, BLAS: {BLAS}")
    for name, t in med.items():
        print(f"{name}: {t * 1e3:.2f} ms a layer, {t / base:.2f}x the float matmuls")
    return med


if __name__ == "__main__":
    main()
