"""Routing benchmark: `--routing-policy` A/B on replicas, alternating in one run.

    python -m benchmarks.routing --preset tiny --dp-size 2 --repeats 3

Each repeat starts a fresh `radix-mlx serve --dp-size N` per policy (in ABBA order over the
repeats, so drift on a shared machine hits both alike), sends the `multi-tenant` workload
(the same prompts to both: tenants with long system prefixes, interleaved) and reads the
cached-token share and TTFT p50 from the client side. The policy under test and the
baseline (round_robin) are compared by the median over repeats of each repeat's ratio.
Then the router overhead: the same workload at `--overhead-concurrency` streams, with the
routing call's own CPU time read from `radix_mlx_routing_seconds` (sum / count) on
/metrics (CPU, not wall time: on a shared machine the wall time of a 20 us call is mostly
the OS running someone else).
Each replica's pool (`--pool-tokens`) holds, by default, 5/8 of the tenants' system
prefixes: the pools together hold them all with room to spare (1.25x), one alone does not
(0.62x). That is the case a cache-aware router is for (SGLang's gateway): where every
replica could keep every prefix, routing would not matter; where two pools could not keep
them either, no routing could keep them cached. Between the two, what stays cached is
decided by where each tenant's requests go.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.records import WorkloadSpec
from benchmarks.report import compute_metrics, format_table
from benchmarks.serving import ManagedServer, bench_run, resolve_model, warm_up
from common.tiny_presets import PRESETS
from router.serving.model_files import load_tokenizer

BASELINE = "round_robin"


def routing_time(url: str) -> tuple[float, int]:
    """(seconds, decisions) the routing policy took so far, from /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    values = {
        s.name: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith("radix_mlx_routing_seconds")
    }
    return values["radix_mlx_routing_seconds_sum"], int(values["radix_mlx_routing_seconds_count"])


async def one_run(args, model: str, tokenizer, policy: str, spec: WorkloadSpec,
                  concurrency: int, repeat: int) -> dict:  # fmt: skip
    extra = ["--dp-size", str(args.dp_size), "--routing-policy", policy,
             "--max-total-tokens", str(pool_tokens(args)), *args.server_args]  # fmt: skip
    server = ManagedServer("radix-mlx", model, Path(args.output_dir) / "logs", extra)
    ep = await asyncio.to_thread(server.start)
    try:
        await warm_up(ep, "http", tokenizer, 2)
        before = routing_time(ep.url)
        run = await bench_run(ep, "http", spec, tokenizer, concurrency, seed=args.seed + repeat,
                              progress=False)  # fmt: skip
        after = routing_time(ep.url)
    finally:
        server.stop()
    m = compute_metrics(run)
    print(f"--- {policy}, repeat {repeat + 1}, concurrency {concurrency}", flush=True)
    print(format_table(run, m), flush=True)
    decisions = max(1, after[1] - before[1])
    m["routing_ms"] = 1000 * (after[0] - before[0]) / decisions
    return m


def pool_tokens(args) -> int:
    """--pool-tokens, or 5/8 of the tenants' system prefixes (see the module's doc)."""
    return args.pool_tokens or args.tenants * args.system_len * 5 // 8


def _spec(args) -> WorkloadSpec:
    return WorkloadSpec("multi-tenant", dict(
        tenants=args.tenants, requests_per_tenant=args.requests_per_tenant,
        system_len=args.system_len, question_len=args.question_len, output_len=args.output_len,
    ))  # fmt: skip


async def run(args) -> int:
    model = resolve_model(args)
    tokenizer = load_tokenizer(model)
    spec = _spec(args)
    ratios: dict[str, list[float]] = {"cached_share": [], "median_ttft_ms": []}
    failed = 0
    for repeat in range(args.repeats):
        order = [args.policy, BASELINE] if repeat % 2 == 0 else [BASELINE, args.policy]
        got = {}
        for policy in order:
            got[policy] = await one_run(args, model, tokenizer, policy, spec,
                                        args.max_concurrency, repeat)  # fmt: skip
            failed += got[policy]["failed"]
        for name in ratios:
            ratios[name].append(got[args.policy][name] / max(got[BASELINE][name], 1e-9))
    overhead = await one_run(args, model, tokenizer, args.policy, spec,
                             args.overhead_concurrency, args.repeats)  # fmt: skip
    failed += overhead["failed"]
    print(f"\n{args.policy} / {BASELINE}, {args.dp_size} replicas, multi-tenant "
          f"({args.tenants} tenants x {args.requests_per_tenant}), pools of "
          f"{pool_tokens(args)} tokens, concurrency {args.max_concurrency}; median of "
          f"{args.repeats} repeats (each repeat's ratio):")  # fmt: skip
    for name, values in ratios.items():
        if not values:  # --repeats 0: the overhead run alone
            continue
        each = ", ".join(f"{v:.2f}" for v in values)
        print(f"  {name}: {statistics.median(values):.2f}x  ({each})")
    print(f"routing call at {args.overhead_concurrency} concurrent streams: "
          f"{overhead['routing_ms']:.3f} ms per request "
          "(mean CPU time, radix_mlx_routing_seconds)")  # fmt: skip
    return 1 if failed else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--model-path", help="any mlx-lm model directory (default: build --preset offline)")
    a("--preset", choices=sorted(PRESETS), default="tiny")
    a("--policy", choices=["cache_aware", "least_load"], default="cache_aware")
    a("--dp-size", type=int, default=2)
    a("--pool-tokens", type=int, help="--max-total-tokens of each replica "
      "(default: 5/8 of tenants x system-len, 10,240 for the defaults)")  # fmt: skip
    a("--tenants", type=int, default=16)
    a("--requests-per-tenant", type=int, default=8)
    a("--system-len", type=int, default=1024)
    a("--question-len", type=int, default=32)
    a("--output-len", type=int, default=16)
    a("--max-concurrency", type=int, default=8)
    a("--overhead-concurrency", type=int, default=64)
    a("--repeats", type=int, default=3, help="A/B pairs (0: only the overhead run)")
    a("--seed", type=int, default=0)
    a("--server-args", type=str.split, default=[], help="extra `radix-mlx serve` flags")
    a("--output-dir", default="bench_results")
    p.set_defaults(loop=False)  # serving.resolve_model builds the preset's plain variant
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
