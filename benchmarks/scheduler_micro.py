"""Micro-benchmark of the scheduler's own overhead: `python -m benchmarks.scheduler_micro`.

1. Time per decode step with N running requests, driving the in-process `Scheduler`
   directly (no sockets, no model): `next_batch()` + `on_result()` + `take_outputs()`.
   Also the wire cost (encode + decode) of one N-request `DecodeBatch`.
2. Radix trie match + insert throughput over random requests that share prefixes, on a
   `RadixCache` + `TokenToKVPoolAllocator`, evicting least-recently-used leaves when short.

Prints one line per figure and appends a JSON line to bench_results/scheduler.jsonl.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from common.messages import (
    WORKER_INBOX,
    DecodeBatch,
    ExtendBatch,
    GenerateReq,
    SamplingParams,
    StepResult,
    WorkerReady,
)
from common.protocol import decode, encode
from common.server_args import ServerArgs
from scheduler.memory_pool import TokenToKVPoolAllocator
from scheduler.radix_cache import RadixCache
from scheduler.scheduler import Scheduler

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "bench_results" / "scheduler.jsonl"
VOCAB = 32000
TOKEN = 7  # what the synthetic worker "samples": never eos


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def bench_decode(n_reqs: int, steps: int, prompt_len: int = 128, seed: int = 0) -> dict:
    """Scheduler time per decode step with `n_reqs` running requests."""
    rng = random.Random(seed)
    max_new = steps + 64
    num_slots = n_reqs * (prompt_len + max_new) + 1024
    args = ServerArgs(model_path="x", max_running_requests=n_reqs, decode_log_interval=10**9)
    ready = WorkerReady(
        num_slots=num_slots,
        model_type="bench",
        num_layers=1,
        n_kv_heads=1,
        head_dim=1,
        dtype="float16",
        context_len=prompt_len + max_new + 1,
        vocab_size=VOCAB,
        eos_token_ids=[0],
        blas="none",
    )
    sched = Scheduler(args, ready)
    shared = [rng.randrange(1, VOCAB) for _ in range(prompt_len // 2)]
    for i in range(n_reqs):
        prompt = shared + [rng.randrange(1, VOCAB) for _ in range(prompt_len - len(shared))]
        sampling = SamplingParams(max_new_tokens=max_new, temperature=0.0)
        sched.on_request(GenerateReq(f"r{i}", prompt, sampling))

    def answer(batch) -> StepResult:
        if isinstance(batch, ExtendBatch):
            rids = [r.rid for r in batch.reqs if r.last_chunk]
        else:
            rids = batch.rids
        return StepResult(batch.step, rids, [TOKEN] * len(rids))

    for _ in range(10 * n_reqs + 100):  # prefill everything (and take the first decode)
        batch = sched.next_batch()
        if isinstance(batch, DecodeBatch) and len(batch.rids) == n_reqs:
            break
        sched.on_result(answer(batch))
        sched.take_outputs()
    else:
        raise RuntimeError(f"never reached {n_reqs} decoding requests")
    sched.on_result(answer(batch))
    sched.take_outputs()
    sample_batch = batch

    times: list[float] = []
    clock = time.perf_counter
    for _ in range(steps):
        t0 = clock()
        batch = sched.next_batch()
        sched.on_result(StepResult(batch.step, batch.rids, [TOKEN] * len(batch.rids)))
        sched.take_outputs()
        times.append(clock() - t0)
        assert len(batch.rids) == n_reqs
    assert not sched.waiting and sched.retracted == 0

    frame = encode(sample_batch)
    reps = max(200, min(5000, steps))
    enc, dec = [], []
    for _ in range(reps):
        t0 = clock()
        frame = encode(sample_batch)
        t1 = clock()
        decode(frame, WORKER_INBOX)
        dec.append(clock() - t1)
        enc.append(t1 - t0)
    return {
        "decode_reqs": n_reqs,
        "decode_steps": steps,
        "decode_step_ms_median": statistics.median(times) * 1e3,
        "decode_step_ms_p99": _percentile(times, 0.99) * 1e3,
        "decode_batch_bytes": len(frame),
        "decode_batch_encode_us": statistics.median(enc) * 1e6,
        "decode_batch_decode_us": statistics.median(dec) * 1e6,
    }


def bench_trie(n_requests: int, pool_tokens: int, seed: int = 0) -> dict:
    """match_prefix + insert throughput, evicting LRU leaves when the pool is short."""
    rng = random.Random(seed)
    families = [[rng.randrange(VOCAB) for _ in range(rng.randrange(64, 512))] for _ in range(64)]
    requests = []
    for _ in range(n_requests):
        base = rng.choice(families)
        head = base[: rng.randrange(len(base) // 2, len(base) + 1)]
        requests.append(head + [rng.randrange(VOCAB) for _ in range(rng.randrange(16, 256))])
    total = sum(len(r) for r in requests)

    allocator = TokenToKVPoolAllocator(pool_tokens)
    tree = RadixCache(allocator)
    hit = evicted = 0
    evict_time = 0.0
    clock = time.perf_counter
    t0 = clock()
    for tokens in requests:
        m = tree.match_prefix(tokens)
        tree.inc_lock_ref(m.last_node)
        need = len(tokens) - len(m.slot_ids)
        short = need - allocator.available_size()
        if short > 0:
            t1 = clock()
            evicted += tree.evict(short)
            evict_time += clock() - t1
        new = allocator.alloc(need)
        if new is None:
            raise RuntimeError("pool too small for one request")
        slots = m.slot_ids + new
        done = tree.insert(tokens, slots)
        allocator.free(slots[len(m.slot_ids) : done])
        tree.dec_lock_ref(m.last_node)
        hit += len(m.slot_ids)
    elapsed = clock() - t0
    return {
        "trie_requests": n_requests,
        "trie_pool_tokens": pool_tokens,
        "trie_tokens": total,
        "trie_tokens_per_s": total / elapsed,
        "trie_us_per_request": elapsed / n_requests * 1e6,
        "trie_hit_rate": hit / total,
        "trie_evicted_tokens": evicted,
        "trie_evict_time_share": evict_time / elapsed,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64, help="running requests while decoding")
    p.add_argument("--steps", type=int, default=2000, help="timed decode steps")
    p.add_argument("--trie-requests", type=int, default=10000)
    p.add_argument("--pool-tokens", type=int, default=200_000, help="trie benchmark pool size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON lines file to append to")
    a = p.parse_args(argv)

    row: dict = {"bench": "scheduler", "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    row["python"] = sys.version.split()[0]
    row["machine"] = platform.machine()
    d = bench_decode(a.requests, a.steps, seed=a.seed)
    row.update(d)
    verdict = "ok" if d["decode_step_ms_median"] <= 1.0 else "OVER the 1 ms target"
    print(
        f"decode step, {a.requests} running (scheduler only): median "
        f"{d['decode_step_ms_median']:.3f} ms, p99 {d['decode_step_ms_p99']:.3f} ms over "
        f"{a.steps} steps (target <= 1 ms: {verdict})"
    )
    print(
        f"DecodeBatch of {a.requests} requests ({d['decode_batch_bytes']} bytes): encode "
        f"{d['decode_batch_encode_us']:.1f} us + decode {d['decode_batch_decode_us']:.1f} us"
    )
    t = bench_trie(a.trie_requests, a.pool_tokens, seed=a.seed)
    row.update(t)
    print(
        f"trie match+insert: {t['trie_tokens_per_s'] / 1e6:.2f}M tokens/s "
        f"({t['trie_us_per_request']:.1f} us/request) over {a.trie_requests} requests, "
        f"{t['trie_tokens'] / 1e6:.2f}M tokens, hit rate {t['trie_hit_rate']:.0%}, "
        f"{t['trie_evicted_tokens']} tokens evicted from a {a.pool_tokens}-token pool "
        f"({t['trie_evict_time_share']:.0%} of the time in evict)"
    )
    roomy = bench_trie(a.trie_requests, t["trie_tokens"] + 1, seed=a.seed)
    row["trie_tokens_per_s_no_evict"] = roomy["trie_tokens_per_s"]
    print(
        f"trie match+insert without eviction (pool holds everything): "
        f"{roomy['trie_tokens_per_s'] / 1e6:.2f}M tokens/s "
        f"({roomy['trie_us_per_request']:.1f} us/request)"
    )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with a.out.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(f"appended to {a.out}")
    return row


if __name__ == "__main__":
    main()
