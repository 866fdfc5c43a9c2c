"""The end of a benchmark run: medians over repeats, the comparison, the issue's targets.

On this 2-core VM one run of a load moves by 20-40% from one minute to the next, in both
backends' figures. So the suite runs its plan `--repeats` times (3 by default, each with
fresh servers and another seed, every backend in turn), takes each target's ratio within
each repeat, where both backends ran minutes apart, and checks the median of those ratios.
The issue's own orientation figures are medians of 3 seeds too.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import agent_sessions as agents
from benchmarks.peers import PEER_BACKENDS, describe
from benchmarks.plots import save_plots
from benchmarks.records import INPROCESS, RunResult
from benchmarks.report import REFERENCE, best_peer, comparison_table, metric

BEST = "best peer"  # a Target's side: the peer with the most output tok/s on that load


@dataclass
class Target:
    """An issue target: value(num) / value(den) `op` bound, on one load."""

    label: str
    workload: str
    concurrency: int | None
    num: tuple[str, str]  # (backend, metric)
    den: tuple[str, str]
    op: str  # ">=" or "<="
    bound: float


def report(results: list[tuple[RunResult, dict]], args) -> int:
    """Comparison, targets, plots; exit status 1 if any request failed."""
    summary = median_over_repeats(results)
    repeats = len(_repeats(results))
    medians = f" (each figure the median of {repeats} repeats)" if repeats > 1 else ""
    print(f"\ncomparison{medians}:\n" + comparison_table(summary))
    if args.suite:
        targets = SUITE_TARGETS[args.suite]
        print(f"\nissue targets (radix-mlx, {args.preset} model; the median of the repeats' "
              "ratios):")  # fmt: skip
        print("\n".join(check_targets(results, targets)))
    if args.suite == "agent-sessions":
        print("\n".join(agents.summary_lines(summary)))
    if any(run.backend in PEER_BACKENDS for run, _ in results):
        print("\nwhat the peers were sent (none takes token ids or ignore_eos):\n" + describe())
    for backend, why in getattr(args, "not_installed", {}).items():
        print(f"\nNOT MEASURED: {backend} did not install: {why}")
    if not args.no_plots:
        for path in save_plots(summary, Path(args.output_dir)):
            print(f"plot: {path}")
    failed = sum(m["failed"] for _, m in results)
    if failed:
        print(f"\n{failed} request(s) failed; see the tables above", file=sys.stderr)
    return 1 if failed else 0


def check_targets(results: list[tuple[RunResult, dict]], targets: list[Target]) -> list[str]:
    """One line per target: the median over repeats of its ratio, and each repeat's."""
    lines = []
    for t in targets:
        ratios = [r for rep in _repeats(results) if (r := _ratio(results, t, rep)) is not None]
        if not ratios:
            lines.append(f"  [ n/a ] {t.label}: a run is missing")
            continue
        value = statistics.median(ratios)
        ok = value >= t.bound if t.op == ">=" else value <= t.bound
        each = f"; repeats: {', '.join(f'{r:.3f}' for r in ratios)}" if len(ratios) > 1 else ""
        lines.append(
            f"  [{'met' if ok else 'MISS':^5}] {t.label}: {value:.3f} ({t.op} {t.bound}{each})"
        )
    return lines


def _repeats(results: list[tuple[RunResult, dict]]) -> list[int]:
    return sorted({run.repeat for run, _ in results})


def _ratio(results: list[tuple[RunResult, dict]], t: Target, repeat: int) -> float | None:
    found = {
        run.backend: m
        for run, m in results
        if run.repeat == repeat
        and run.workload.name == t.workload
        and run.max_concurrency == t.concurrency
    }
    if BEST in (t.num[0], t.den[0]) and best_peer(found) is not None:
        found[BEST] = found[best_peer(found)]
    try:
        return metric(found[t.num[0]], t.num[1]) / metric(found[t.den[0]], t.den[1])
    except (KeyError, ZeroDivisionError):
        return None


def median_over_repeats(results: list[tuple[RunResult, dict]]) -> list[tuple[RunResult, dict]]:
    """One (run, metrics) per backend and load: every repeat's requests pooled (for the
    TTFT plots) and each number the median over the repeats."""
    groups: dict[tuple[str, str], list[tuple[RunResult, dict]]] = defaultdict(list)
    for run, m in results:
        groups[(run.backend, run.load_key())].append((run, m))
    out = []
    for pairs in groups.values():
        runs = [run for run, _ in pairs]
        pooled = [r for run in runs for r in run.requests]
        run = dataclasses.replace(runs[0], requests=pooled)
        out.append((run, _median(m for _, m in pairs)))
    return out


def _median(metrics) -> dict[str, Any]:
    """Numbers by their median, nested dicts key by key, anything else from the first."""
    metrics = list(metrics)
    out = {}
    for key, first in metrics[0].items():
        values = [m.get(key) for m in metrics]
        if isinstance(first, dict):
            out[key] = _median(v for v in values if isinstance(v, dict))
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = statistics.median(values)
        else:
            out[key] = first
    return out


STANDARD_TARGETS = [
    Target(
        "shared-prefix c8 output tok/s ÷ mlx-lm",
        "generated-shared-prefix",
        8,
        ("radix-mlx", "output_throughput"),
        (REFERENCE, "output_throughput"),
        ">=",
        2.5,
    ),
    Target(
        "shared-prefix c8 TTFT p50 ÷ mlx-lm",
        "generated-shared-prefix",
        8,
        ("radix-mlx", "median_ttft_ms"),
        (REFERENCE, "median_ttft_ms"),
        "<=",
        0.3,
    ),
    Target(
        "multi-turn c8 TTFT p50 ÷ mlx-lm",
        "multi-turn",
        8,
        ("radix-mlx", "median_ttft_ms"),
        (REFERENCE, "median_ttft_ms"),
        "<=",
        0.5,
    ),
    Target(
        "repeat warm TTFT ÷ mlx-lm warm TTFT",
        "repeat",
        1,
        ("radix-mlx", "ttft_warm"),
        (REFERENCE, "ttft_warm"),
        "<=",
        0.5,
    ),
    Target(
        "repeat warm TTFT ÷ own cold TTFT",
        "repeat",
        1,
        ("radix-mlx", "ttft_warm"),
        ("radix-mlx", "ttft_cold"),
        "<=",
        0.02,
    ),
    Target(
        "random c8 output tok/s ÷ mlx-lm",
        "random",
        8,
        ("radix-mlx", "output_throughput"),
        (REFERENCE, "output_throughput"),
        ">=",
        1.2,
    ),
    Target(
        "agent c8 TTFT p50 ÷ mlx-lm",
        "agent",
        8,
        ("radix-mlx", "median_ttft_ms"),
        (REFERENCE, "median_ttft_ms"),
        "<=",
        0.3,
    ),
]


def _against(label: str, workload: str, name: str, op: str, bound: float, den=BEST):
    """radix-mlx ÷ the best peer (or `den`) on a c8 load of the standard suite."""
    return Target(label, workload, 8, ("radix-mlx", name), (den, name), op, bound)


# issue 32: against the best of every peer, and against radix-mlx's own replay in-process
STANDARD_TARGETS += [
    _against("shared-prefix c8 output tok/s ÷ best peer", "generated-shared-prefix",
             "output_throughput", ">=", 2.5),
    _against("shared-prefix c8 ITL p50 ÷ best peer", "generated-shared-prefix",
             "median_itl_ms", "<=", 0.8),
    _against("random c8 output tok/s ÷ best peer", "random", "output_throughput", ">=", 1.5),
    _against("random c8 output tok/s HTTP ÷ in-process", "random", "output_throughput",
             ">=", 0.9, den=INPROCESS),
    _against("shared-prefix c8 output tok/s HTTP ÷ in-process", "generated-shared-prefix",
             "output_throughput", ">=", 0.9, den=INPROCESS),
]  # fmt: skip


def _decode_speedup(label: str, workload: str, concurrency: int, bound: float) -> Target:
    """n-gram speculation's decode throughput ÷ radix-mlx's without it: the inverse ratio
    of their median time per output token after the first."""
    base, spec = ("radix-mlx", "median_tpot_ms"), ("radix-mlx-ngram", "median_tpot_ms")
    return Target(label, workload, concurrency, base, spec, ">=", bound)


SPECULATIVE_TARGETS = [
    _decode_speedup("code-edit c1 decode tok/s ngram ÷ none", "code-edit", 1, 1.8),
    _decode_speedup("code-edit c8 decode tok/s ngram ÷ none", "code-edit", 8, 1.4),
    _decode_speedup("random c1 decode tok/s ngram ÷ none", "random", 1, 0.95),
    _decode_speedup("random c8 decode tok/s ngram ÷ none", "random", 8, 0.95),
]


def _tier(label: str, num: tuple[str, str], den: tuple[str, str], op: str, bound: float):
    return Target(label, agents.WORKLOAD, agents.SUITE_CONCURRENCY, num, den, op, bound)


# issue 31: the disk tier on agent sessions whose working set is 4x the pool
AGENT_SESSIONS_TARGETS = [
    _tier("cached share, disk tier ÷ big pool", (agents.DISK_TIER, "cached_share"),
          (agents.BIG_POOL, "cached_share"), ">=", 0.9),
    _tier("TTFT p50, disk tier ÷ no tier", (agents.DISK_TIER, "median_ttft_ms"),
          (agents.NO_TIER, "median_ttft_ms"), "<=", 0.35),
    _tier("decode ITL p99 while the tier writes ÷ tier off (big pool)",
          (agents.BIG_POOL_DISK_TIER, "p99_itl_ms"), (agents.BIG_POOL, "p99_itl_ms"), "<=", 1.1),
]  # fmt: skip
SUITE_TARGETS = {"standard": STANDARD_TARGETS, "speculative": SPECULATIVE_TARGETS,
                 "agent-sessions": AGENT_SESSIONS_TARGETS}  # fmt: skip
