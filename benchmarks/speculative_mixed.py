"""One request whose drafts hold among others whose drafts fail, n-gram speculation or none.

    python -m benchmarks.speculative_mixed [--preset medium] [--rows 8] [--repeats 2]

On the preset's looping build, one greedy request (its output cycles, so its n-gram
drafts are accepted) decodes beside `--rows - 1` requests sampled at temperature 1 (their
outputs repeat nothing), all sent at once with 192 random prompt tokens and 128 out. A
step where any row drafts is a verify step for every row, so what is measured is what the
other rows pay for one row's drafts: their median TPOT without speculation ÷ with it
(and the greedy row's own), per repeat, fresh servers in ABBA order.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
from pathlib import Path

from benchmarks.records import Prompt, RequestResult
from benchmarks.serving import ManagedServer
from benchmarks.transports import HttpSender
from benchmarks.workloads import send_one
from common.tiny_presets import PRESETS

OUTPUT = 128
BACKENDS = ("radix-mlx", "radix-mlx-ngram")


async def tpots(url: str, prompts: list[list[int]]) -> list[float]:
    """Each request's seconds per output token after the first (as `report` counts TPOT):
    the first prompt's greedy, the others' sampled at temperature 1, all at once."""
    greedy = HttpSender(url, text_prompts=False, connections=1)
    sampled = HttpSender(url, False, len(prompts), sampling={"temperature": 1.0})
    results = [RequestResult(f"row{i}", len(p), OUTPUT) for i, p in enumerate(prompts)]
    try:
        await asyncio.gather(*[
            send_one(greedy if i == 0 else sampled, Prompt(p, ""), OUTPUT, res)
            for i, (p, res) in enumerate(zip(prompts, results))
        ])  # fmt: skip
    finally:
        await greedy.close()
        await sampled.close()
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) failed: {failed[0]}")
    return [(r.latency - r.ttft) / (r.output_len - 1) for r in results]


async def one_run(backend: str, model: str, rows: int, repeat: int, logs: Path):
    server = ManagedServer(backend, model, logs, [])
    ep = await asyncio.to_thread(server.start)
    try:
        rng = random.Random(repeat)
        await tpots(ep.url, [[rng.randrange(3, 500) for _ in range(16)]])  # warm-up
        got = await tpots(
            ep.url, [[rng.randrange(3, 500) for _ in range(192)] for _ in range(rows)]
        )
    finally:
        server.stop()
    return got[0], statistics.median(got[1:])


async def run(args) -> None:
    from common.tiny_model import ensure_tiny_model

    model = str(ensure_tiny_model(preset=args.preset, loop=True))
    for repeat in range(args.repeats):
        got = {}
        for backend in BACKENDS[:: 1 if repeat % 2 == 0 else -1]:
            got[backend] = await one_run(backend, model, args.rows, repeat, Path(args.logs))
        (g0, s0), (g1, s1) = got["radix-mlx"], got["radix-mlx-ngram"]
        print(f"repeat {repeat + 1}: the {args.rows - 1} sampled rows' median TPOT "
              f"{s0 * 1e3:.1f} ms without speculation, {s1 * 1e3:.1f} with ({s0 / s1:.2f}x); "
              f"the greedy row's {g0 * 1e3:.1f} and {g1 * 1e3:.1f} ({g0 / g1:.2f}x)",
              flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="medium")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--logs", default="bench_results/logs")
    asyncio.run(run(p.parse_args(argv)))


if __name__ == "__main__":
    main()
