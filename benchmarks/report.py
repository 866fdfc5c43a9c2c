"""Results of `benchmarks.serving`: per-run metrics, tables, JSONL lines, comparison.

Everything here is computed from client-side timestamps and the servers' own usage
counts, so the same code judges every backend.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.peers import PEER_BACKENDS
from benchmarks.records import INPROCESS, RequestResult, RunResult

REFERENCE = "mlx-lm"


BUSY_CORES = 0.25  # more CPU than this used by other processes disturbs a run


class CpuMeter:
    """CPU the machine spent outside this benchmark (client + the server tree it started),
    so a run disturbed by other work on a small machine is flagged, not silently reported."""

    def __init__(self, pids: list[int]):
        self.pids = pids
        self.start = (time.perf_counter(), _machine_busy(), _tree_cpu(pids))

    def foreign_cores(self) -> float | None:
        """Average cores used by other processes since construction (None off Linux)."""
        t0, busy0, ours0 = self.start
        busy, ours = _machine_busy(), _tree_cpu(self.pids)
        if busy is None or busy0 is None:
            return None
        return max(0.0, (busy - busy0) - (ours - ours0)) / max(time.perf_counter() - t0, 1e-9)


def _machine_busy() -> float | None:
    """Busy CPU seconds of the whole machine, from /proc/stat."""
    try:
        fields = open("/proc/stat").readline().split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    guest = sum(ticks[8:10])  # already counted in user and nice
    return (sum(ticks) - idle - guest) / os.sysconf("SC_CLK_TCK")


def _tree_cpu(roots: list[int]) -> float:
    """CPU seconds used so far by `roots` and all their descendants."""
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                rest = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = (int(rest[1]), (int(rest[11]) + int(rest[12])))
    ours, frontier = set(), [p for p in roots if p in stats]
    while frontier:
        pid = frontier.pop()
        ours.add(pid)
        frontier += [c for c, (ppid, _) in stats.items() if ppid == pid and c not in ours]
    return sum(stats[p][1] for p in ours) / os.sysconf("SC_CLK_TCK")


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """Mean, median and p99 in ms (zeros when there is nothing to measure)."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    a = np.asarray(values) * scale
    return {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "p99": float(np.percentile(a, 99)),
    }


def compute_metrics(run: RunResult) -> dict[str, Any]:
    """SGLang's serving metrics plus the consistency checks this tool promises."""
    ok = [r for r in run.requests if r.ok]
    inp, out = sum(r.prompt_len for r in ok), sum(r.output_len for r in ok)
    dur = max(run.duration, 1e-9)
    m: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(run.requests) - len(ok),
        "errors": sorted({r.error for r in run.requests if not r.ok})[:5],
        "duration_s": run.duration,
        "total_input_tokens": inp,
        "total_output_tokens": out,
        "requested_output_tokens": sum(r.requested_len for r in ok),
        "request_throughput": len(ok) / dur,
        "input_throughput": inp / dur,
        "output_throughput": out / dur,
        "total_throughput": (inp + out) / dur,
        "concurrency": sum(r.latency for r in ok) / dur,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "cached_share": sum(r.cached_tokens for r in ok) / max(inp, 1),
        "short_outputs": sum(r.output_len != r.requested_len for r in ok),
        "prompt_len_mismatches": sum(
            r.reported_prompt_len is not None and r.reported_prompt_len != r.prompt_len for r in ok
        ),
        "stream_count_mismatches": sum(
            r.streamed_tokens is not None and r.streamed_tokens != r.output_len for r in ok
        ),
    }
    for name, values in (
        ("ttft", [r.ttft for r in ok]),
        ("itl", [x for r in ok for x in r.itls]),
        ("tpot", [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]),
        ("e2e", [r.latency for r in ok]),
    ):
        for stat, v in _stats(values).items():
            m[f"{stat}_{name}_ms"] = v
    m["ttft_by_label_ms"] = _by_label(ok)
    m["cached_share_by_label"] = _cached_by_label(ok)
    m["first_token_held_by_mlx_lm"] = run.info.get("first_token_held_by_mlx_lm")
    m["foreign_cpu_cores"] = run.info.get("foreign_cpu_cores")
    m["worker_decode_step_ms"] = run.info.get("worker_decode_step_ms")  # in-process only
    return m


def _by_label(ok: list[RequestResult]) -> dict[str, float]:
    """Median TTFT per label (cold/warm, turn1..n) when a run has more than one."""
    groups: dict[str, list[float]] = defaultdict(list)
    for r in ok:
        groups[r.label].append(r.ttft)
    if len(groups) < 2:
        return {}
    return {k: float(np.median(v)) * 1000 for k, v in groups.items()}


def _cached_by_label(ok: list[RequestResult]) -> dict[str, float]:
    """Cached share of the prompt tokens per label (turn1..n) when a run has several."""
    prompt: dict[str, int] = defaultdict(int)
    cached: dict[str, int] = defaultdict(int)
    for r in ok:
        prompt[r.label] += r.prompt_len
        cached[r.label] += r.cached_tokens
    if len(prompt) < 2:
        return {}
    return {k: cached[k] / max(prompt[k], 1) for k in prompt}


def format_table(run: RunResult, m: dict[str, Any]) -> str:
    """The result block SGLang's bench_serving prints, plus cache and sanity lines."""
    rows: list[tuple[str, Any]] = [
        ("Backend", f"{run.backend} ({run.transport})"),
        ("Workload", run.workload.key()),
        ("Traffic request rate", run.request_rate),
        ("Max request concurrency", run.max_concurrency or "not set"),
        ("Successful requests", m["completed"]),
        ("Failed requests", m["failed"]),
        ("Benchmark duration (s)", f"{m['duration_s']:.2f}"),
        ("Total input tokens", m["total_input_tokens"]),
        ("Total generated tokens", m["total_output_tokens"]),
        ("Requested generated tokens", m["requested_output_tokens"]),
        ("Request throughput (req/s)", f"{m['request_throughput']:.2f}"),
        ("Input token throughput (tok/s)", f"{m['input_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{m['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{m['total_throughput']:.2f}"),
        ("Concurrency", f"{m['concurrency']:.2f}"),
        ("Cached-token share", f"{m['cached_share']:.1%}"),
    ]
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{k + ':':<42}{v}" for k, v in rows]
    for title, key in (
        ("End-to-End Latency", "e2e"),
        ("Time to First Token", "ttft"),
        ("Time per Output Token (excl. 1st token)", "tpot"),
        ("Inter-Token Latency", "itl"),
    ):
        lines.append("{s:{c}^50}".format(s=f" {title} ", c="-"))
        for stat in ("mean", "median", "p99"):
            lines.append(
                f"{f'{stat.capitalize()} {key.upper()} (ms):':<42}{m[f'{stat}_{key}_ms']:.2f}"
            )
    for label, v in m["ttft_by_label_ms"].items():
        lines.append(f"{f'Median TTFT {label} (ms):':<42}{v:.2f}")
    for label, v in m.get("cached_share_by_label", {}).items():
        lines.append(f"{f'Cached-token share {label}:':<42}{v:.1%}")
    lines += _warnings(m)
    lines.append("=" * 50)
    return "\n".join(lines)


def _warnings(m: dict[str, Any]) -> list[str]:
    """Loud lines for anything that makes the numbers inconsistent."""
    out = [f"FAILED: {m['failed']} request(s): {e}" for e in m["errors"][:1] if m["failed"]]
    out += [f"  error: {e}" for e in m["errors"][1:]]
    if m["short_outputs"]:
        out.append(f"WARNING: {m['short_outputs']} request(s) got a different output length")
    if m["prompt_len_mismatches"]:
        out.append(f"WARNING: server counted other prompt lengths for {m['prompt_len_mismatches']}")
    if m["stream_count_mismatches"]:
        out.append(f"WARNING: streamed tokens != usage for {m['stream_count_mismatches']}")
    foreign = m.get("foreign_cpu_cores")
    if foreign is not None and foreign > BUSY_CORES:
        out.append(f"WARNING: other processes used {foreign:.2f} CPU cores during this run")
    return out


def jsonl_row(run: RunResult, m: dict[str, Any]) -> dict[str, Any]:
    """One self-describing line: the load, the backend, the machine, the numbers."""
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "backend": run.backend,
        "transport": run.transport,
        "workload": run.workload.name,
        "workload_params": run.workload.params,
        "max_concurrency": run.max_concurrency,
        "request_rate": run.request_rate,
        "repeat": run.repeat,
        **run.info,
        **m,
        "ttfts_ms": [round(r.ttft * 1000, 3) for r in run.requests if r.ok],
    }


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")


COMPARE_ROWS = (
    ("output tok/s", "output_throughput", "{:.1f}"),
    ("TTFT p50 ms", "median_ttft_ms", "{:.1f}"),
    ("TTFT p99 ms", "p99_ttft_ms", "{:.1f}"),
    ("ITL p50 ms", "median_itl_ms", "{:.2f}"),
    ("E2E p50 ms", "median_e2e_ms", "{:.1f}"),
    ("cached share", "cached_share", "{:.1%}"),
)


def metric(m: dict[str, Any], name: str) -> float:
    """A comparison metric, including per-label TTFTs like `ttft_warm`."""
    if name.startswith("ttft_") and name[5:] in m["ttft_by_label_ms"]:
        return m["ttft_by_label_ms"][name[5:]]
    if name.startswith("cached_share_"):
        return m.get("cached_share_by_label", {}).get(name[13:], math.nan)
    return float(m[name])


def comparison_table(results: list[tuple[RunResult, dict]]) -> str:
    """Side by side per load, with each backend ÷ mlx_lm.server."""
    groups: dict[str, dict[str, dict]] = defaultdict(dict)
    for run, m in results:
        groups[run.load_key()][run.backend] = m
    backends = list(dict.fromkeys(run.backend for run, _ in results))
    others = [b for b in backends if b not in PEER_BACKENDS]
    ratio_cols = [f"{b}÷{REFERENCE}" for b in others] if REFERENCE in backends else []
    peers = [b for b in backends if b in PEER_BACKENDS]
    best_col = "radix-mlx" in backends and bool(peers)
    ratio_cols += [BEST_PEER] if best_col else []
    widths = [max(12, len(c) + 2) for c in backends + ratio_cols]
    head = f"{'load / metric':<34}" + "".join(
        f"{c:>{w}}" for c, w in zip(backends + ratio_cols, widths)
    )
    lines = [head, "-" * len(head)]
    for key, per in groups.items():
        lines.append(key)
        for title, name, fmt in _rows_for(per):
            cells = [fmt.format(metric(per[b], name)) if b in per else "-" for b in backends]
            cells += [_ratio(per, b, name) for b in others] if REFERENCE in backends else []
            cells += [_ratio(per, "radix-mlx", name, best_peer(per))] if best_col else []
            lines.append(f"  {title:<32}" + "".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
        if best_col and best_peer(per):
            lines.append(f"  best peer (by output tok/s): {best_peer(per)}")
        lines += serving_overhead(per)
        lines += _held_note(per)
        busy = [
            f"{b} {m['foreign_cpu_cores']:.2f}"
            for b, m in per.items()
            if (m.get("foreign_cpu_cores") or 0) > BUSY_CORES
        ]
        if busy:
            lines.append(f"  WARNING: other processes' CPU cores during: {', '.join(busy)}")
    return "\n".join(lines)


def _held_note(per: dict[str, dict]) -> list[str]:
    """mlx_lm.server streams text, not ids: a first token that is a partial UTF-8 byte
    (or a lone space) is held back, so its TTFT includes one more decode step."""
    held = [(b, m["first_token_held_by_mlx_lm"]) for b, m in per.items() if b != REFERENCE]
    held = [(b, n) for b, n in held if n]
    if REFERENCE not in per or not held:
        return []
    b, n = held[0]
    return [
        f"  note: {n}/{per[b]['completed']} first tokens ({b}'s greedy output) are ones "
        f"{REFERENCE} holds back a decode step before streaming"
    ]


def _rows_for(per: dict[str, dict]) -> list[tuple[str, str, str]]:
    labels = set().union(*(m["ttft_by_label_ms"].keys() for m in per.values()))
    extra = [
        (f"TTFT {lab} ms", f"ttft_{lab}", "{:.1f}") for lab in ("cold", "warm") if lab in labels
    ]
    turns = sorted((lab for lab in labels if lab.startswith("turn")), key=lambda x: int(x[4:]))
    for lab in turns:  # a conversation's turns: what the cache held and how soon it answered
        extra += [(f"cached share {lab}", f"cached_share_{lab}", "{:.1%}"),
                  (f"TTFT {lab} ms", f"ttft_{lab}", "{:.1f}")]  # fmt: skip
    return list(COMPARE_ROWS) + extra


BEST_PEER = "radix-mlx÷best peer"


def best_peer(per: dict[str, dict]) -> str | None:
    """The peer with the most output tok/s on this load (None if no peer ran it)."""
    peers = [b for b in per if b in PEER_BACKENDS]
    return max(peers, key=lambda b: metric(per[b], "output_throughput"), default=None)


def serving_overhead(per: dict[str, dict]) -> list[str]:
    """What the serving path costs, where radix-mlx ran over HTTP and in-process
    (benchmarks.replay): output tok/s of one ÷ the other, and the HTTP ITL p50 ÷ the
    worker's own median decode step in the replay."""
    if "radix-mlx" not in per or INPROCESS not in per:
        return []
    http, local = per["radix-mlx"], per[INPROCESS]
    line = "  serving overhead: HTTP ÷ in-process output tok/s "
    line += _ratio(per, "radix-mlx", "output_throughput", INPROCESS)
    step = local.get("worker_decode_step_ms")
    if step:
        line += f"; HTTP ITL p50 ÷ worker decode step {http['median_itl_ms'] / step:.2f}x"
        line += f" (step {step:.2f} ms)"
    return [line]


def _ratio(per: dict[str, dict], backend: str, name: str, den_backend: str = REFERENCE) -> str:
    """backend ÷ mlx_lm.server (or another); none for shares, where a ratio of near-zeros
    means nothing."""
    if backend not in per or den_backend not in per or name.startswith("cached_share"):
        return "-"
    den = metric(per[den_backend], name)
    return f"{metric(per[backend], name) / den:.2f}x" if den else "-"


def held_first_tokens(tokenizer, reqs: list[RequestResult]) -> int | None:
    """Requests whose first token mlx_lm.server's detokenizer would hold back (partial UTF-8
    or a lone space), so its first text chunk comes a decode step late: a TTFT caveat."""
    firsts = [r.output_ids[0] for r in reqs if r.output_ids]
    if not firsts:
        return None
    return sum(
        tokenizer.decode([t]).endswith("\ufffd") or tokenizer.decode([t]) == " " for t in firsts
    )
