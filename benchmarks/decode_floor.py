"""The batch decode step as context grows, against the memory-traffic floor.

    python -m benchmarks.decode_floor --preset medium --context 1024 8192 [32768]

For each context length, `benchmarks.one_batch` times the decode step of a batch (8 by
default) whose every row holds that many tokens of context: a cached prefix, then a few
new prompt tokens. A step must read the weights once and each row's K/V (the rows'
attention reads the shared prefix once per row), so at the machine's bandwidth
(`benchmarks.bandwidth`) it cannot take less than

    floor = (weight bytes + rows x context x K/V bytes per token) / bandwidth

and the step's time is reported as a multiple of that floor. Context is counted in the
middle of the timed steps. 32k on the medium preset prefills 32k tokens first: minutes
on a small CPU, so choose the lengths.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks import bandwidth, one_batch
from common.tiny_presets import PRESETS

DEFAULT_OUT = Path("bench_results/decode_floor.jsonl")


def weight_bytes(model_path: str) -> int:
    """Bytes of the model's weights as stored, which is how the step reads them."""
    return sum(f.stat().st_size for f in Path(model_path).glob("*.safetensors"))


def floor_row(step: dict, weights: int, gbps: float, context: float) -> dict:
    """One context length's step against its floor (`step` a one_batch row)."""
    rows = step["batch_size"]
    kv = rows * context * step["kv_bytes_per_token"]
    floor = (weights + kv) / (gbps * 1e9)
    return {
        "context": context,
        "batch_size": rows,
        "decode_step_s": step["median_decode_latency"],
        "weight_bytes": weights,
        "kv_bytes_read": kv,
        "bandwidth_gbps": gbps,
        "floor_s": floor,
        "step_vs_floor": step["median_decode_latency"] / floor,
    }


def measure(args: argparse.Namespace, model: str, gbps: float) -> list[dict]:
    weights = weight_bytes(model)
    out = []
    for ctx in args.context:
        prefix = ctx - args.input_len
        rows = one_batch.main(
            ["--model-path", model, "--batch-size", str(args.batch_size)]
            + ["--cached-prefix-len", str(prefix), "--input-len", str(args.input_len)]
            + ["--output-len", str(args.output_len), "--rounds", str(args.rounds)]
            + ["--result-file", args.one_batch_file]
        )
        middle = ctx + args.output_len / 2
        out.append(floor_row(rows[0], weights, gbps, middle))
    return out


def print_table(rows: list[dict]) -> None:
    print(f"\n{'context':>8} {'step ms':>9} {'floor ms':>9} {'step÷floor':>11} "
          f"{'weights MB':>11} {'K/V MB':>8}")  # fmt: skip
    for r in rows:
        print(
            f"{r['context']:>8.0f} {r['decode_step_s'] * 1e3:>9.2f} {r['floor_s'] * 1e3:>9.2f} "
            f"{r['step_vs_floor']:>10.2f}x {r['weight_bytes'] / 1e6:>11.1f} "
            f"{r['kv_bytes_read'] / 1e6:>8.1f}"
        )


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", help="default: --preset, built offline")
    p.add_argument("--preset", default="medium", choices=sorted(PRESETS))
    p.add_argument("--context", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--input-len", type=int, default=16, help="new tokens after the prefix")
    p.add_argument("--output-len", type=int, default=16, help="decode steps + 1")
    p.add_argument("--rounds", type=int, default=3, help="one_batch passes; the median")
    p.add_argument("--bandwidth-mib", type=int, default=512)
    p.add_argument("--result-file", default=str(DEFAULT_OUT))
    p.add_argument("--one-batch-file", default="bench_results/bench_one_batch.jsonl")
    args = p.parse_args(argv)
    if min(args.context) <= args.input_len:
        p.error("every --context must exceed --input-len")
    model = args.model_path or str(one_batch._preset_model(args.preset))
    gbps = bandwidth.measure(args.bandwidth_mib)["gbps"]
    print(f"bandwidth (copy, read + write bytes): {gbps:.1f} GB/s")
    rows = measure(args, model, gbps)
    print_table(rows)
    path = Path(args.result_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    with path.open("a") as f:
        for r in rows:
            f.write(json.dumps({"time": stamp, "model": model, **r}) + "\n")
    return rows


if __name__ == "__main__":
    main()
