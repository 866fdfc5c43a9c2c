"""Switching between two loaded models: a request's latency when the one before it went to
the other model, against its latency when the one before it went to the same model.

    python -m benchmarks.model_switch --rounds 4 --requests 6 --max-tokens 32

starts `radix-mlx serve` with two models, both loaded (no --max-loaded-models): the tiny
Qwen3 and the tiny Llama, or `--model-path A --other-model-path B`. Each round sends, one
at a time, `--requests` requests to A in a row, as many to B in a row, then as many
alternating A, B, A, ... Every request is a new random prompt (`--prompt-len` tokens, so
no prefix is cached) streaming `--max-tokens` greedy tokens; the client times its TTFT and
its decode time per token (TPOT). Per model: the median in a row, alternating, and their
ratio. The target (issue 33): no cost beyond each model's own step, a ratio of 1.0 within
the machine's noise. Rounds interleave the two orders so the machine's drift hits both.
With --gap S the client waits S seconds before each request, so every request meets
processes that idled (on the CPU, a process that just ran answers faster than one that
waited, whichever model it serves).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

from benchmarks.model_load import other_model
from benchmarks.soak import save_record, start_server
from benchmarks.sse import iter_sse_data


def timed_request(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(TTFT, seconds per token after the first) of one streamed greedy completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    started, first = time.perf_counter(), None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read().decode()}")
        for data in iter_sse_data(r):
            if '"error"' in data:
                raise RuntimeError(data)
            if data != "[DONE]":
                first = first or time.perf_counter()
    ended = time.perf_counter()
    return first - started, (ended - first) / max(max_tokens - 1, 1)


def run_rounds(url: str, models: list[str], args: argparse.Namespace) -> list[dict]:
    rng = random.Random(0)
    rows = []
    for i in range(args.rounds):
        orders = {
            "in a row": [m for m in models for _ in range(args.requests)],
            "alternating": [models[j % 2] for j in range(2 * args.requests)],
        }
        for order, sequence in orders.items():
            for model in sequence:
                time.sleep(args.gap)
                prompt = [rng.randrange(3, 500) for _ in range(args.prompt_len)]
                ttft, tpot = timed_request(url, model, prompt, args.max_tokens)
                rows.append({"round": i, "order": order, "model": model, "ttft_s": ttft,
                             "tpot_s": tpot})  # fmt: skip
    return rows


def report(rows: list[dict], models: list[str]) -> str:
    lines = ["model                   TTFT ms row / alt  ratio   TPOT ms row / alt  ratio"]
    for model in models:
        med = {
            (order, key): 1000 * statistics.median(
                r[key] for r in rows if r["model"] == model and r["order"] == order
            )
            for order in ("in a row", "alternating")
            for key in ("ttft_s", "tpot_s")
        }  # fmt: skip
        parts = []
        for key in ("ttft_s", "tpot_s"):
            row, alt = med[("in a row", key)], med[("alternating", key)]
            parts.append(f"{row:>7.2f} / {alt:>7.2f}  {alt / row:>5.2f}x")
        lines.append(f"{model:<22} " + "   ".join(parts))
    lines.append("ratio: alternating / in a row (target 1.0: no cost beyond each model's step)")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.model_switch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--requests", type=int, default=6, help="per model and order in a round")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--gap", type=float, default=0.0, help="seconds idle before each request")
    p.add_argument("--model-path", default=None, help="default: the tiny Qwen3")
    p.add_argument("--other-model-path", default=None, help="default: the tiny Llama")
    p.add_argument("--out", default="bench_results", help="directory for the JSON record")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    other = other_model(args.other_model_path)
    server_args = f"--model-path {other} --max-total-tokens 4096 --restart-wait-timeout 600"
    server, model, _, _ = start_server(args.model_path, server_args, "model-switch")
    models = [Path(model).name, Path(other).name]
    try:
        for name in models:  # both loaded and warm before anything is timed
            timed_request(server.url, name, [5, 6, 7, 8], 4)
        rows = run_rounds(server.url, models, args)
    finally:
        server.stop()
    text = report(rows, models)
    print(text)
    save_record(args.out, "model-switch", {"rows": rows, "report": text})
    return 0


if __name__ == "__main__":
    sys.exit(main())
