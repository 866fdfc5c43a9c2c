"""The first request to a model that is not loaded: its TTFT against its load time.

    python -m benchmarks.model_load --rounds 4

starts `radix-mlx serve` with two models (the tiny Qwen3 and the tiny Llama, or
`--model-path A --other-model-path B`) under `--max-loaded-models 1`, and each round
streams a one-token completion to the model that is not loaded (so each round unloads
one model and loads the other). Per round: the TTFT the client saw, the pair's load time
as the server measured it (`radix_mlx_model_load_seconds`: from the load decision to the
scheduler's ready report, the unload of the other model included) and the difference,
which is what the request costs beyond the load, and TTFT / (load + 1 s). The target
(issue 33): TTFT <= the load time + 1 s, a ratio <= 1. `mlx_lm.load` in a fresh process
is printed for scale.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.soak import model_load_seconds, save_record, start_server
from benchmarks.sse import iter_sse_data


def load_seconds_sum(url: str) -> float:
    """The server's total model load time so far (radix_mlx_model_load_seconds_sum)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "radix_mlx_model_load_seconds_sum":
                return sample.value
    raise RuntimeError("no radix_mlx_model_load_seconds in /metrics")


def first_token_seconds(url: str, model: str) -> float:
    body = {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 1, "stream": True}
    started = time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read().decode()}")
        for data in iter_sse_data(r):
            if '"error"' in data:
                raise RuntimeError(data)
            return time.monotonic() - started
    raise RuntimeError("the stream ended without a token")


def loaded(url: str) -> dict[str, bool]:
    cards = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    return {card["id"]: card["loaded"] for card in cards}


def run_rounds(url: str, rounds: int) -> list[dict]:
    out = []
    for i in range(rounds):
        model = next(name for name, up in loaded(url).items() if not up)
        before = load_seconds_sum(url)
        ttft = first_token_seconds(url, model)
        load = load_seconds_sum(url) - before
        out.append({"round": i, "model": model, "ttft_s": ttft, "load_s": load,
                    "beyond_load_s": ttft - load})  # fmt: skip
    return out


def report(rows: list[dict], mlx_load: dict[str, float]) -> str:
    lines = ["round  model                  TTFT s  load s  TTFT-load s  TTFT/(load+1 s)"]
    for r in rows:
        ratio = r["ttft_s"] / (r["load_s"] + 1)
        lines.append(f"{r['round']:>5}  {r['model']:<22} {r['ttft_s']:>6.2f}  {r['load_s']:>6.2f}"
                     f"  {r['beyond_load_s']:>11.3f}  {ratio:>15.2f}")  # fmt: skip
    beyond = [r["beyond_load_s"] for r in rows]
    lines.append(f"median TTFT - load {statistics.median(beyond):.3f} s, max {max(beyond):.3f} s "
                 f"(target <= 1 s); mlx_lm.load: "
                 + ", ".join(f"{m} {s:.2f} s" for m, s in mlx_load.items()))  # fmt: skip
    return "\n".join(lines)


def other_model(path: str | None) -> str:
    """The second model of a two-model server: `path`, or the tiny Llama."""
    if path is not None:
        return path
    from common.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model(Path.home() / ".cache" / "radix-mlx", arch="llama"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.model_load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--model-path", default=None, help="default: the tiny Qwen3")
    p.add_argument("--other-model-path", default=None, help="default: the tiny Llama")
    p.add_argument("--out", default="bench_results", help="directory for the JSON record")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    other = other_model(args.other_model_path)
    server_args = (f"--model-path {other} --max-loaded-models 1 --max-total-tokens 4096 "
                   "--restart-wait-timeout 600")  # fmt: skip
    server, model, _, _ = start_server(args.model_path, server_args, "model-load")
    try:
        rows = run_rounds(server.url, args.rounds)
    finally:
        server.stop()
    mlx_load = {Path(m).name: model_load_seconds(m) for m in (model, other)}
    text = report(rows, mlx_load)
    print(text)
    save_record(args.out, "model-load", {"rounds": rows, "mlx_lm_load_s": mlx_load,
                                         "report": text})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
