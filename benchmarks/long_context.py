"""A long prompt through the worker's ModelRunner, in the scheduler's chunks, then a
batched decode over that context; peak memory measured.

    python -m benchmarks.long_context [--preset small] [--context 32768] \
        [--chunked-prefill-size 2048] [--batch-size 4] [--output-len 32] \
        [--kv-cache-dtype auto int8]

The prompt is sent as the scheduler sends it: extends of at most --chunked-prefill-size
tokens, each after the earlier chunks as its pool prefix; inside each the worker runs
passes of its prefill step (256 on the CPU). Then --batch-size requests that share the
prompt as a cached prefix and add a few tokens each decode together. For each pool
storage it prints the prefill time, the decode step, MLX's peak memory during each
phase (`mx.get_peak_memory`, reset before it) next to the pool's size and the largest
attention score matrix a pass can build (one pass's tokens x the context x query heads x
4 bytes), and the process's peak RSS.

With --prompt-lens N ... it measures the --max-memory admission instead: the server's
scheduler and the worker's runner in one process, each prompt length's peak against the
admission's prediction (benchmarks/memory_prediction.py; --max-memory as the server's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import time
from pathlib import Path

from common.tiny_presets import PRESETS
from worker_mlx.backends.blas import preload_openblas

BLAS = preload_openblas()

import mlx.core as mx  # noqa: E402

from benchmarks.one_batch import GREEDY, SlotList  # noqa: E402
from common.messages import DecodeBatch, ExtendBatch, ExtendReq, ReleaseReq  # noqa: E402
from worker_mlx.backends import select  # noqa: E402
from worker_mlx.kv_pool import MlxKVPool  # noqa: E402
from worker_mlx.model_probe import probe_kv_layout  # noqa: E402
from worker_mlx.model_runner import ModelRunner  # noqa: E402

MiB = 2**20


def prefill_in_chunks(runner, slots: SlotList, prompt: list[int], chunk: int) -> list[int]:
    """Extend `prompt` as the scheduler would, `chunk` tokens at a time; its slots."""
    done: list[int] = []
    for start in range(0, len(prompt), chunk):
        piece = prompt[start : start + chunk]
        last = start + chunk >= len(prompt)
        req = ExtendReq("long", piece, list(done), slots.take(len(piece)), GREEDY, last)
        runner.extend(ExtendBatch(start, [req]))
        done += req.out_cache_loc
    runner.release([ReleaseReq("long", flush=True)])
    return done


def decode_batch(runner, slots, prefix, bs: int, steps: int, vocab: int) -> list[float]:
    """`bs` requests of the cached `prefix` plus 4 tokens each, decoded together; the
    step times (the first, which builds the decode buffer from the pool, left out)."""
    reqs = [
        ExtendReq(f"d{i}", [(i * 7 + j) % vocab for j in range(4)], prefix, slots.take(4), GREEDY)
        for i in range(bs)
    ]
    runner.extend(ExtendBatch(0, reqs))
    rids = [r.rid for r in reqs]
    times = []
    for step in range(steps):
        t = time.perf_counter()
        runner.decode(DecodeBatch(step + 1, rids, slots.take(bs)))
        times.append(time.perf_counter() - t)
    runner.release([ReleaseReq(rid, flush=False) for rid in rids])
    return times[1:]


def run(model, layout, backend, kv_dtype: str, args: argparse.Namespace) -> dict:
    need = args.context + args.batch_size * (args.output_len + 8) + 64
    layout = dataclasses.replace(layout, kv_cache_dtype=kv_dtype)
    pool = MlxKVPool(layout, need)
    runner = ModelRunner(
        model, pool, model.args.vocab_size, prefill_step=backend.prefill_step,
        compile_decode=backend.compile_decode,
    )  # fmt: skip
    slots = SlotList(need)
    prompt = mx.random.randint(3, 300, (args.context,), key=mx.random.key(args.seed)).tolist()
    mx.reset_peak_memory()
    t = time.perf_counter()
    prefix = prefill_in_chunks(runner, slots, prompt, args.chunked_prefill_size)
    prefill = time.perf_counter() - t
    prefill_peak = mx.get_peak_memory()
    mx.reset_peak_memory()
    steps = decode_batch(runner, slots, prefix, args.batch_size, args.output_len, 300)
    heads = model.args.num_attention_heads
    row = dict(
        kv_cache_dtype=kv_dtype, context=args.context, batch_size=args.batch_size,
        chunked_prefill_size=args.chunked_prefill_size, prefill_step=backend.prefill_step,
        prefill_s=prefill, prefill_tok_s=args.context / prefill,
        median_decode_step_s=statistics.median(steps),
        pool_mib=sum(a.nbytes for a in pool.arrays()) / MiB,
        score_matrix_mib=backend.prefill_step * args.context * heads * 4 / MiB,
        full_score_matrix_mib=args.context * args.context * heads * 4 / MiB,
        prefill_peak_mib=prefill_peak / MiB, decode_peak_mib=mx.get_peak_memory() / MiB,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )  # fmt: skip
    del runner, pool
    mx.clear_cache()
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    from mlx_lm import load

    from common.tiny_model import ensure_tiny_model

    path = args.model_path or str(ensure_tiny_model(preset=args.preset))
    if args.prompt_lens:
        from benchmarks import memory_prediction

        return memory_prediction.main(args, path, BLAS)
    backend = select(cpu_kernels=True)
    model, _ = load(path)
    layout = probe_kv_layout(model)
    uninstall = backend.install(model)
    print(f"model {path}: {layout}, BLAS: {BLAS}, backend {backend.describe()}")
    rows = []
    try:
        for kv_dtype in args.kv_cache_dtype:
            row = run(model, layout, backend, kv_dtype, args)
            row.update(model=path)
            print(_line(row))
            rows.append(row)
    finally:
        uninstall()
    p = Path(args.result_file)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("a") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return rows


def _line(r: dict) -> str:
    return (
        f"KV {r['kv_cache_dtype']}: {r['context']:,}-token prompt in {r['chunked_prefill_size']}"
        f"-token chunks ({r['prefill_step']}-token passes): {r['prefill_s']:.1f} s "
        f"({r['prefill_tok_s']:.0f} tok/s), MLX peak {r['prefill_peak_mib']:.0f} MiB "
        f"(pool {r['pool_mib']:.0f} MiB; one pass's scores {r['score_matrix_mib']:.0f} MiB, "
        f"the whole prompt's would be {r['full_score_matrix_mib']:,.0f} MiB); decode batch "
        f"{r['batch_size']} at that context: {r['median_decode_step_s'] * 1e3:.1f} ms a step, "
        f"MLX peak {r['decode_peak_mib']:.0f} MiB; peak RSS {r['peak_rss_mib']:.0f} MiB"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="model dir (default: --preset)")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--context", type=int, default=32768, help="prompt tokens")
    p.add_argument("--chunked-prefill-size", type=int, default=2048, help="as the server flag")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument(
        "--kv-cache-dtype", nargs="+", default=["auto"],
        choices=["auto", "bf16", "fp16", "int8", "int4"],
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prompt-lens", type=int, nargs="*", default=None,
        help="measure the --max-memory admission at these prompt lengths instead",
    )  # fmt: skip
    p.add_argument("--max-memory", default=None, help="with --prompt-lens: as the server flag")
    p.add_argument("--result-file", default="bench_results/long_context.jsonl")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
