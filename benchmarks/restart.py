"""Restart time: SIGKILL the worker with streams in flight, time the recovery.

    python -m benchmarks.restart --kills 5

starts `radix-mlx serve` on the tiny model (or `--model-path`) and, `--kills` times:
opens `--streams` long streaming completions, waits for a token on each, SIGKILLs the
worker, and times how long each stream takes to get its error event and how long
`/health` takes to answer 503 and then 200 again. Before each kill it waits `--settle`
seconds, so the server is in its steady state (its standbys, if any, spawned). The
target (issue 17) is /health 200 again within the model's load time (mlx_lm.load in a
fresh process) + 3 s and every in-flight error within 2 s of the kill.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import httpx

from benchmarks.soak import Kill, _kill_worker, model_load_seconds, save_record, start_server
from benchmarks.sse import aiter_sse_data


async def _stream(http: httpx.AsyncClient, url: str, prompt: list[int], first, errors, kill):
    body = {"prompt": prompt, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread()).decode()}")
        async for data in aiter_sse_data(r):
            if '"error"' in data:
                errors.append(time.monotonic() - kill.at)
                return
            first.set()


async def one_kill(url: str, router_pid: int, streams: int) -> Kill:
    kill = Kill(0.0)
    async with httpx.AsyncClient(timeout=120) as http:
        firsts = [asyncio.Event() for _ in range(streams)]
        tasks = [asyncio.create_task(_stream(http, url, [5 + i, 6, 7], f, kill.in_flight_errors,
                                             kill)) for i, f in enumerate(firsts)]  # fmt: skip
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 60)
        await _kill_worker(url, router_pid, kill)
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
    return kill


async def run(url: str, router_pid: int, args: argparse.Namespace) -> list[Kill]:
    kills = []
    for _ in range(args.kills):
        await asyncio.sleep(args.settle)
        kills.append(await one_kill(url, router_pid, args.streams))
    return kills


def report(kills: list[Kill], load: float) -> str:
    lines = [f"model load (mlx_lm.load, fresh process): {load:.2f} s"]
    for i, k in enumerate(kills, 1):
        lines.append(
            f"kill {i}: /health 503 after {k.to_503:.2f} s, 200 again after {k.to_200:.2f} s; "
            f"{len(k.in_flight_errors)} in-flight errors, the last after "
            f"{max(k.in_flight_errors):.2f} s"
        )
    to_200 = statistics.median(k.to_200 for k in kills)
    errors = max(max(k.in_flight_errors) for k in kills)
    lines.append(
        f"median kill to /health 200: {to_200:.2f} s = load + {to_200 - load:.2f} s "
        f"(target: load + 3 s); slowest in-flight error {errors:.2f} s (target: 2 s)"
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.restart", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--streams", type=int, default=4, help="streams in flight at each kill")
    p.add_argument("--settle", type=float, default=5.0, help="seconds before each kill")
    p.add_argument("--model-path", default=None, help="default: the tiny model")
    p.add_argument("--server-args", default="--max-total-tokens 4096")
    p.add_argument("--out", default="bench_results", help="directory for the JSON record")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server, model, log, _ = start_server(args.model_path, args.server_args, "restart")
    try:
        kills = asyncio.run(run(server.url, server.proc.pid, args))
    finally:
        server.stop()
    load = model_load_seconds(model)
    text = report(kills, load)
    print(text)
    record = {"args": vars(args), "report": text, "mlx_lm_load_s": load,
              "kills": [vars(k) for k in kills], "server_log": str(log)}  # fmt: skip
    save_record(args.out, "restart", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
