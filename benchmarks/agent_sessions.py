"""The agent-sessions workload (issue 31): coding agents whose sessions outgrow the pool.

    python -m benchmarks.serving --suite agent-sessions      # the issue's comparison
    python -m benchmarks.serving --workload agent-sessions --backend radix-mlx-disk-tier

N sessions of T turns. A turn's prompt is the session's previous prompt, the answer the
server gave to it, and something new: a tool result, or (every other turn) a shorter user
message. Sessions run side by side under a concurrency cap below N, so their turns queue
in session order and interleave: round k sends every session's k-th turn. The server's
pool (`--max-total-tokens`) is sized from the workload: its working set (every distinct
token of every session) ÷ `pool_multiple`. By the time a session's next turn arrives, the
other sessions' turns have pushed its history out of the pool; without a lower tier it is
recomputed, with `--kv-disk-dir` it is read back.

The suite runs the load on four radix-mlx servers that differ only in these flags:

- radix-mlx-disk-tier: the small pool and the disk tier (in a fresh temporary directory);
- radix-mlx: the small pool alone;
- radix-mlx-big-pool: a pool that holds the whole working set, the best any cache can do;
- radix-mlx-big-pool-disk-tier: that pool and the tier, which then writes every finished
  turn and reads nothing back: its decode ITL beside radix-mlx-big-pool's is what the
  tier's writes cost the running requests.
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

from benchmarks.records import Session, SuiteLoad, WorkloadSpec

if TYPE_CHECKING:
    from benchmarks.workloads import PromptFactory

WORKLOAD = "agent-sessions"
DISK_TIER = "radix-mlx-disk-tier"
NO_TIER = "radix-mlx"
BIG_POOL = "radix-mlx-big-pool"
BIG_POOL_DISK_TIER = "radix-mlx-big-pool-disk-tier"
BACKENDS = (DISK_TIER, BIG_POOL, BIG_POOL_DISK_TIER)  # the servers this module adds
DISK_TIER_BACKENDS = (DISK_TIER, BIG_POOL_DISK_TIER)
SUITE_BACKENDS = (DISK_TIER, NO_TIER, BIG_POOL, BIG_POOL_DISK_TIER)
# The workload's sessions are ~40x shorter than a real agent's (1.7k tokens, not 50-100k),
# so its blocks are too: a turn's history is on disk up to its last whole block, and a
# 256-token block would leave ~1/10 of each history to recompute where a real session
# loses ~1/500. `--server-args "--kv-disk-block-tokens 256"` overrides it.
DISK_BLOCK_TOKENS = 64
BIG_POOL_MULTIPLE = 2  # the big pool holds twice the working set: nothing is ever evicted

# 12 sessions x 6 turns of 0.8k-1.7k tokens: a working set of 17k tokens, a pool of 4.3k
DEFAULTS = dict(sessions=12, turns=6, system_len=256, task_len=512, result_len=192,
                message_len=64, output_len=32, pool_multiple=4.0)  # fmt: skip
SUITE_CONCURRENCY = 2


def agent_session_sessions(
    f: PromptFactory, sessions: int, turns: int, system_len: int, task_len: int,
    result_len: int, message_len: int, output_len: int, pool_multiple: float,
) -> list[Session]:  # fmt: skip
    """The sessions: one system prompt shared by all, then per session a task and T-1 new
    pieces, a tool result at even turns and a user message at odd ones; each turn carries
    the whole history forward (benchmarks.workloads.run_session). `pool_multiple` does not
    shape the prompts: it is how many pools the working set fills (`pool_tokens`)."""
    system = f.prompt(system_len)
    labels = [f"turn{t + 1}" for t in range(turns)]
    out = []
    for _ in range(sessions):
        task = f.prompt(len(system.ids) + task_len, prefix=system)
        pieces = [f.piece(n) for n in piece_lens(turns, result_len, message_len)]
        out.append(Session([task, *pieces], [output_len] * turns, labels, carry_history=True))
    return out


def piece_lens(turns: int, result_len: int, message_len: int) -> list[int]:
    """What turns 2..T add after the previous answer: a tool result, then a user message,
    alternately."""
    return [result_len if t % 2 else message_len for t in range(1, turns)]


def session_tokens(p: dict) -> int:
    """A session's own tokens at its end: task, new pieces and every answer."""
    pieces = sum(piece_lens(p["turns"], p["result_len"], p["message_len"]))
    return p["task_len"] + pieces + p["turns"] * p["output_len"]


def working_set_tokens(p: dict) -> int:
    """Every distinct token the workload puts in a cache: the shared system prompt once,
    and each session's own. Counts what the pool would need to hold all of it."""
    return p["system_len"] + p["sessions"] * session_tokens(p)


def longest_request_tokens(p: dict) -> int:
    """The last turn's prompt and answer: what one running request holds in the pool."""
    return p["system_len"] + session_tokens(p)


def pool_tokens(p: dict) -> int:
    return math.ceil(working_set_tokens(p) / p["pool_multiple"])


def check_fits(p: dict, concurrency: int | None) -> None:
    """Refuse a load whose running requests alone would not fit the small pool."""
    running = (concurrency or p["sessions"]) * longest_request_tokens(p)
    if running > pool_tokens(p):
        raise ValueError(
            f"agent-sessions: {concurrency or p['sessions']} running requests of up to "
            f"{longest_request_tokens(p)} tokens do not fit a pool of {pool_tokens(p)} "
            f"(the working set {working_set_tokens(p)} ÷ {p['pool_multiple']}): add "
            "sessions or lower the concurrency"
        )


def server_flags(backend: str, spec: WorkloadSpec) -> list[str]:
    """`radix-mlx serve` flags sized from the workload, for radix-mlx servers running it:
    the pool (small, or big for the big-pool servers) and the tier's block size."""
    if spec.name != WORKLOAD or not backend.startswith("radix-mlx"):
        return []
    big = backend in (BIG_POOL, BIG_POOL_DISK_TIER)
    tokens = working_set_tokens(spec.params) * BIG_POOL_MULTIPLE if big else None
    flags = ["--max-total-tokens", str(tokens or pool_tokens(spec.params))]
    if backend in DISK_TIER_BACKENDS:
        flags += ["--kv-disk-block-tokens", str(DISK_BLOCK_TOKENS)]
    return flags


def suite(args: argparse.Namespace | None = None) -> list[SuiteLoad]:
    """The issue's comparison: one load (sized by the --as-* flags in `args`) on the four
    servers, at SUITE_CONCURRENCY."""
    p = params_from_args(args) if args is not None else dict(DEFAULTS)
    check_fits(p, SUITE_CONCURRENCY)
    return [SuiteLoad(WorkloadSpec(WORKLOAD, p), [SUITE_CONCURRENCY], SUITE_BACKENDS)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The workload's flags on benchmarks.serving's command line."""
    g = p.add_argument_group("agent-sessions workload (issue 31)")
    for name, value in DEFAULTS.items():
        flag = "--as-" + name.replace("_", "-")
        g.add_argument(flag, type=type(value), default=value, dest=f"as_{name}")


def params_from_args(args: argparse.Namespace) -> dict:
    return {name: getattr(args, f"as_{name}") for name in DEFAULTS}


def summary_lines(results: list) -> list[str]:
    """What the targets leave out, for the report: the working set and each server's pool,
    cached share (the no-tier one is the figure the issue asks to report) and the
    figures the targets divide."""
    lines = []
    for run, m in results:
        if run.workload.name != WORKLOAD:
            continue
        if not lines:
            ws = working_set_tokens(run.workload.params)
            lines.append(f"agent-sessions: working set {ws} tokens")
        flags = server_flags(run.backend, run.workload)
        pool = flags[1] if flags else "?"
        lines.append(f"  {run.backend}: cached share {m['cached_share']:.3f}, TTFT p50 "
                     f"{m['median_ttft_ms']:.1f} ms, ITL p99 {m['p99_itl_ms']:.1f} ms (pool "
                     f"{pool} tokens)")  # fmt: skip
    return lines
