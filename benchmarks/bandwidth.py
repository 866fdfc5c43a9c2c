"""This machine's memory bandwidth, from copying a large array (STREAM's "copy").

    python -m benchmarks.bandwidth [--mib 512] [--repeats 5]

Copies an array far larger than the caches with numpy and with mlx, several times, and
reports the best pass of each in GB/s, counting the bytes read and the bytes written
(2 x the array's size), as STREAM does. The best of the two is the machine's figure:
what a decode step that only streamed its weights and K/V through memory could reach
(benchmarks/decode_floor.py sets the decode step against it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from worker_mlx.backends.blas import preload_openblas

BLAS = preload_openblas()  # the worker's mlx, before the first import of mlx

import mlx.core as mx  # noqa: E402

DEFAULT_OUT = Path("bench_results/bandwidth.jsonl")


def timed(run: Callable[[], None], repeats: int) -> tuple[float, float]:
    """(best, median) seconds of `repeats` calls after one untimed call (page faults,
    caches)."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def best_seconds(run: Callable[[], None], repeats: int) -> float:
    """The fastest of `repeats` timed calls, after one untimed call."""
    return timed(run, repeats)[0]


def numpy_copy_gbps(nbytes: int, repeats: int) -> float:
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    seconds = best_seconds(lambda: np.copyto(dst, src), repeats)
    return 2 * src.nbytes / seconds / 1e9


def mlx_copy_gbps(nbytes: int, repeats: int) -> float:
    """An elementwise op into a new array: mlx's copy, on its default device."""
    src = mx.ones((nbytes // 4,), dtype=mx.float32)
    mx.eval(src)
    seconds = best_seconds(lambda: mx.eval(src + 0), repeats)
    return 2 * src.nbytes / seconds / 1e9


def measure(mib: int = 512, repeats: int = 5) -> dict:
    """Both copies' GB/s and the best of them (`gbps`), with what they ran on."""
    nbytes = mib << 20
    row = {
        "array_mib": mib,
        "repeats": repeats,
        "numpy_copy_gbps": numpy_copy_gbps(nbytes, repeats),
        "mlx_copy_gbps": mlx_copy_gbps(nbytes, repeats),
        "device": str(mx.default_device()),
    }
    row["gbps"] = max(row["numpy_copy_gbps"], row["mlx_copy_gbps"])
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=512, help="array size (far above the caches)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--result-file", default=str(DEFAULT_OUT))
    args = p.parse_args(argv)
    row = measure(args.mib, args.repeats)
    print(
        f"copy bandwidth ({args.mib} MiB, best of {args.repeats}; read + write bytes): "
        f"numpy {row['numpy_copy_gbps']:.1f} GB/s, mlx {row['mlx_copy_gbps']:.1f} GB/s "
        f"on {row['device']}; this machine: {row['gbps']:.1f} GB/s"
    )
    out = Path(args.result_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **row}) + "\n")
    return row


if __name__ == "__main__":
    main()
