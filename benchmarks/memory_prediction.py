"""`python -m benchmarks.long_context --prompt-lens 1024 4096 16384`: peak memory of long
prompts against the --max-memory admission's prediction (the long_context mode for it).

Runs the server's own scheduler (scheduler/scheduler.py, with its memory admission) and
the worker's ModelRunner, loaded as the worker loads them (worker_mlx/loader.py), in one
process with no sockets: each prompt length is sent as --batch-size requests of that many
tokens and --output-len greedy tokens each, and every step the scheduler hands out is
executed. Per step it records the admission's prediction (scheduler/memory_budget.py:
what the step adds to what the worker holds) and measures mlx's peak beyond what mlx
held before (`mx.get_peak_memory()`, reset before the step) and the process's peak
resident set (VmHWM, reset through /proc/self/clear_refs). One row per prompt length: the
largest prediction and measurement over its steps and their ratio (below 1: the admission
over-estimates, the safe side), with what the budget refused.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import mlx.core as mx

from common.messages import (
    DecodeBatch,
    ExtendBatch,
    GenerateReq,
    ReqError,
    SamplingParams,
    StepResult,
)
from common.server_args import ServerArgs
from common.sizes import format_size
from scheduler.scheduler import Scheduler
from worker_mlx.buffer_cache import BufferCacheBound
from worker_mlx.loader import load_runner

MiB = 1 << 20


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def reset_rss_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set (Linux >= 4.0)
    except OSError:
        pass


def predicted(sched: Scheduler, batch) -> int:
    """What the admission counted this step to add to the worker's fixed memory."""
    m = sched.memory
    if isinstance(batch, ExtendBatch):
        rows = [(len(r.prefix_slot_ids), len(r.input_ids)) for r in batch.reqs]
        return m.step_bytes([r.seq_len for r in sched.running], rows)
    return m.decode_bytes([sched.reqs[rid].seq_len for rid in batch.rids])


def run_length(sched, runner, n: int, batch: int, output_len: int, tag: str, cache) -> dict:
    sampling = SamplingParams(max_new_tokens=output_len, temperature=0, ignore_eos=True)
    for b in range(batch):
        prompt = [3 + (b * 131 + i * 7) % 500 for i in range(n)]
        sched.on_request(GenerateReq(f"{tag}-{b}", prompt, sampling))
    refused = [o for o in sched.take_outputs() if isinstance(o, ReqError)]
    base_mlx = mx.get_active_memory()
    worst = dict(predicted=0, mlx=0, rss=0, steps=0)
    started = time.perf_counter()
    while sched.busy:
        step = sched.next_batch()
        if step is None:
            time.sleep(0.01)
            continue
        if not isinstance(step, (ExtendBatch, DecodeBatch)):
            runner.release(step.release)
            continue
        guess = predicted(sched, step)
        mx.reset_peak_memory()
        reset_rss_peak()
        out = runner.extend(step) if isinstance(step, ExtendBatch) else runner.decode(step)
        mx.eval(mx.array(0))
        worst["mlx"] = max(worst["mlx"], mx.get_peak_memory() - base_mlx)
        worst["rss"] = max(worst["rss"], peak_rss())
        worst["predicted"] = max(worst["predicted"], guess)
        worst["steps"] += 1
        sched.on_result(StepResult(step.step, out.rids, out.next_token_ids))
        cache.after_step()  # the worker's bound on mlx's buffer cache, as after every step
        refused += [o for o in sched.take_outputs() if isinstance(o, ReqError)]
    worst["seconds"] = time.perf_counter() - started
    worst["refused"] = [f"{o.status} {o.message}" for o in refused]
    return worst


def main(args, model: str, blas: str) -> list[dict]:
    """`args`: long_context's (prompt_lens, batch_size, output_len, max_memory,
    result_file)."""
    longest = max(args.prompt_lens) + args.output_len
    server = ServerArgs(
        model_path=model, max_total_tokens=args.batch_size * longest + 64,
        max_memory=args.max_memory, context_length=max(longest, 4096),
        disable_overlap_schedule=True,
    )  # fmt: skip
    runner, ready = load_runner(server, blas)  # the engine: a runner, or a Verifier around one
    cache = BufferCacheBound(runner.runner.memory.cache)
    sched = Scheduler(server, ready)
    report = ready.memory
    print(
        f"{model}: --max-memory {format_size(report.budget)}, held "
        f"{format_size(report.fixed)} (mlx {format_size(mx.get_active_memory())}, RSS "
        f"{format_size(peak_rss())}), {format_size(report.budget - report.fixed)} for steps; "
        f"batch {args.batch_size}, {args.output_len} tokens out, BLAS {blas}"
    )
    print(
        "| prompt tokens | predicted step | MLX peak | MLX / predicted | predicted total "
        "| peak RSS | RSS / predicted | steps | s |"
    )
    print("|" + "---|" * 9)
    rows = []
    for n in args.prompt_lens:
        row = run_length(sched, runner, n, args.batch_size, args.output_len, f"n{n}", cache)
        row.update(prompt_tokens=n, batch_size=args.batch_size, model=model, blas=blas)
        row["budget"], row["fixed"] = report.budget, report.fixed
        ratio = row["mlx"] / max(row["predicted"], 1)
        total = report.fixed + row["predicted"]  # what admission holds the process to
        refused = f" refused: {'; '.join(row['refused'])}" if row["refused"] else ""
        print(
            f"| {n:,} | {row['predicted'] / MiB:.1f} MiB | {row['mlx'] / MiB:.1f} MiB | "
            f"{ratio:.2f} | {total / MiB:.0f} MiB | {row['rss'] / MiB:.0f} MiB | "
            f"{row['rss'] / total:.2f} | {row['steps']} | {row['seconds']:.1f} |{refused}"
        )
        rows.append(row)
    p = Path(args.result_file)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("a") as f:
        f.writelines(json.dumps(dict(r, mode="admission")) + "\n" for r in rows)
    return rows
