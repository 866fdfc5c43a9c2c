"""Latency of one static batch through the worker's ModelRunner, no server around it.

    python -m benchmarks.one_batch --model-path P --batch-size 1 4 \
        --input-len 60 --output-len 100 [--cached-prefix-len K] [--compare-mlx-lm] [--rounds N]

Prints SGLang's bench_one_batch lines for a warm-up and a benchmark pass and appends one
JSON line per batch size to bench_results/bench_one_batch.jsonl. With --rounds N the
benchmark pass runs N times, batch sizes in turn, and the median pass is reported; with
several batch sizes the decode throughput of each against the first is printed. With
--cached-prefix-len each prompt is K tokens already in the pool followed by --input-len
new tokens. With --compare-mlx-lm it also times mlx-lm's own decode step (generate_step
at batch 1, BatchGenerator above, with mlx's own kernels) in the same run and prints the
ratio. With --tp-size/--pp-size N it runs on N rank processes after one process, and
prints the decode step of each and the collectives' share (benchmarks/ranks.py).
Decode steps run with the server's lookahead unless --no-overlap. With --kv-cache-dtype
A B ... each pool storage gets its own pool and runner, their rounds alternate in one run,
and each one's decode step and tokens per byte of pool are printed against the first's.
With --loras N a runner whose rows run N seeded LoRA adapters of the model in turn
(common/tiny_adapter.py; rank 8 on q_proj and v_proj of every layer) alternates with the
first storage's plain runner, and its decode step is printed against the plain one's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

from common.tiny_presets import PRESETS
from worker_mlx.backends.blas import preload_openblas

BLAS = preload_openblas()

import mlx.core as mx  # noqa: E402

from benchmarks import ranks  # noqa: E402
from common.messages import DecodeBatch, ExtendBatch, ExtendReq, ReleaseReq, SamplingParams  # noqa: E402
from worker_mlx.backends import Backend, select  # noqa: E402
from worker_mlx.kv_pool import MlxKVPool  # noqa: E402
from worker_mlx.lora import NO_LORA, make_bank  # noqa: E402
from worker_mlx.model_probe import probe_kv_layout  # noqa: E402
from worker_mlx.model_runner import ModelRunner  # noqa: E402

GREEDY = SamplingParams(max_new_tokens=1 << 20, temperature=0, ignore_eos=True)


class SlotList:
    """The simplest allocator: enough for a benchmark that frees nothing mid-run."""

    def __init__(self, n: int):
        self.next = 1
        self.n = n

    def take(self, k: int) -> list[int]:
        if self.next + k - 1 > self.n:
            raise RuntimeError("pool too small for this benchmark")
        out = list(range(self.next, self.next + k))
        self.next += k
        return out


def run_batch(runner, slots, prompts, prefix_slots, output_len, tag, overlap=True) -> dict:
    """Extend `prompts` (after `prefix_slots`), decode `output_len - 1` steps, time both.
    With `overlap` each decode step is followed by the lookahead the server's worker runs
    while the scheduler works (`run_ahead`), so a step costs what it costs in the server."""
    n = runner.lora.count  # row i runs adapter 1 + i % n (with --loras)
    reqs = [
        ExtendReq(f"{tag}-{i}", p, list(prefix_slots), slots.take(len(p)), GREEDY,
                  lora=1 + i % n if n else 0)
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    rids = [r.rid for r in reqs]
    start = time.perf_counter()
    runner.extend(ExtendBatch(0, reqs))
    prefill = time.perf_counter() - start
    decode = []
    for step in range(output_len - 1):
        t = time.perf_counter()
        more = overlap and step + 2 < output_len
        runner.decode(DecodeBatch(step + 1, rids, slots.take(len(rids)), lookahead=more))
        runner.run_ahead()
        decode.append(time.perf_counter() - t)
    total = time.perf_counter() - start
    runner.release([ReleaseReq(rid, flush=False) for rid in rids])
    return {"prefill": prefill, "decode": decode, "total": total}


def report(res: dict, bs: int, input_len: int, output_len: int, verbose: bool) -> dict:
    prefill_tokens = bs * input_len
    print(
        f"Prefill. latency: {res['prefill']:.5f} s, "
        f"throughput: {prefill_tokens / res['prefill']:10.2f} token/s"
    )
    for i, lat in enumerate(res["decode"]):
        if verbose or i < 3:
            print(
                f"Decode {i}. Batch size: {bs}, latency: {lat:.5f} s, "
                f"throughput: {bs / lat:10.2f} token/s"
            )
    med = statistics.median(res["decode"]) if res["decode"] else float("nan")
    print(f"Decode.  median latency: {med:.5f} s, median throughput: {bs / med:10.2f} token/s")
    total_tokens = bs * (input_len + output_len)
    print(
        f"Total. latency: {res['total']:6.3f} s, "
        f"throughput: {total_tokens / res['total']:10.2f} token/s"
    )
    return {
        "prefill_latency": res["prefill"],
        "prefill_throughput": prefill_tokens / res["prefill"],
        "median_decode_latency": med,
        "median_decode_throughput": bs / med,
        "total_latency": res["total"],
    }


def mlx_lm_decode_step(model, prompts: list[list[int]], steps: int) -> float:
    """Median decode step of mlx-lm itself: generate_step at batch 1, BatchGenerator above."""
    from mlx_lm.generate import BatchGenerator, generate_step

    times = []
    if len(prompts) == 1:
        gen = generate_step(
            mx.array(prompts[0]), model, max_tokens=steps + 1, sampler=lambda x: mx.argmax(x, -1)
        )
        next(gen)
        t = time.perf_counter()
        for _ in gen:
            now = time.perf_counter()
            times.append(now - t)
            t = now
        return statistics.median(times)
    gen = BatchGenerator(
        model,
        max_tokens=steps + 1,
        completion_batch_size=len(prompts),
        prefill_batch_size=len(prompts),
    )
    gen.insert(prompts)
    while not gen.next_generated():
        pass
    for _ in range(steps - 1):
        t = time.perf_counter()
        if not gen.next_generated():
            break
        times.append(time.perf_counter() - t)
    gen.close()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    from mlx_lm import load

    size = args.tp_size * args.pp_size
    if size > 1 and not ranks.in_rank():  # the baseline, then this command on `size` ranks
        return ranks.launch(sys.argv[1:] if argv is None else argv, size, args.result_file)
    path = args.model_path or str(_preset_model(args.preset))
    backend = select(cpu_kernels=not args.disable_cpu_kernels)
    if size > 1:
        model, group, spec = ranks.load_rank(path, args.tp_size, args.pp_size)
    else:
        model, _ = load(path)
    layout = probe_kv_layout(model)
    uninstall = backend.install(model)
    print(f"model {path}: {layout}, BLAS: {BLAS}, backend {backend.describe()}")
    try:
        results = _benchmark(model, layout, args, backend, path)
    finally:
        uninstall()  # mlx's own kernels and cache limit from here on, as mlx-lm users run it
    run = f"{time.time():.0f}-{os.getpid()}"  # which rows one command appended
    for row in results:
        row.update(model=path, blas=BLAS, run=run)
    if size > 1:
        ranks.add_collectives(results, group, spec, model)
        if spec.rank > 0:
            return results
    elif args.compare_mlx_lm:
        _compare_with_mlx_lm(model, results, args)
    _print_scaling(results)
    _append_jsonl(args.result_file, results)
    return results


def _benchmark(model, layout, args: argparse.Namespace, backend: Backend, path) -> list[dict]:
    """A warm-up pass per batch size and pool storage (and the LoRA runner), then `rounds`
    benchmark passes with batch sizes and setups in turn (so noise spreads over all of
    them); one row per setup and batch size, its median pass."""
    need = (
        args.cached_prefix_len
        + (args.rounds + 1) * sum(args.batch_size) * (args.input_len + args.output_len)
        + 64
    )
    setups = {}  # storage (or "<storage>+N LoRAs") -> (runner, slots, the prefix's slots)
    kinds = [(d, NO_LORA) for d in args.kv_cache_dtype]
    if args.loras:
        kinds.append((args.kv_cache_dtype[0], make_bank(model, _adapters(path, args.loras))))
    for kv_dtype, lora in kinds:
        pool = MlxKVPool(dataclasses.replace(layout, kv_cache_dtype=kv_dtype), need)
        runner = ModelRunner(
            model, pool, model.args.vocab_size, prefill_step=backend.prefill_step,
            compile_decode=backend.compile_decode, pipeline_stage=args.pp_size > 1, lora=lora,
        )  # fmt: skip
        slots = SlotList(need)
        label = f"{kv_dtype}+{lora.count} LoRAs" if lora.count else kv_dtype
        setups[label] = runner, slots, _cached_prefix(runner, slots, args)
    prompts = {bs: _prompts(bs, args) for bs in args.batch_size}
    timed: dict[tuple[str, int], list[dict]] = {}
    for tag, rounds in (("warmup", 1), ("benchmark", args.rounds)):
        for _ in range(rounds):
            for (kv_dtype, (runner, slots, prefix_slots)), bs in _each(setups, args.batch_size):
                res = run_batch(
                    runner, slots, prompts[bs], prefix_slots, args.output_len, tag,
                    not args.no_overlap,
                )  # fmt: skip
                if tag == "warmup":
                    print(_header(tag, bs, args, kv_dtype))
                    report(res, bs, args.input_len, args.output_len, args.verbose)
                else:
                    timed.setdefault((kv_dtype, bs), []).append(res)
    rows = []
    for (kv_dtype, (runner, _, _)), bs in _each(setups, args.batch_size):
        many = f", median of {args.rounds} passes" if args.rounds > 1 else ""
        print(_header("benchmark", bs, args, kv_dtype) + many)
        res = sorted(timed[kv_dtype, bs], key=lambda r: statistics.median(r["decode"]))
        row = report(res[args.rounds // 2], bs, args.input_len, args.output_len, args.verbose)
        row.update(
            batch_size=bs,
            input_len=args.input_len,
            output_len=args.output_len,
            cached_prefix_len=args.cached_prefix_len,
            rounds=args.rounds,
            kv_cache_dtype=runner.pool.layout.kv_cache_dtype,
            setup=kv_dtype,
            loras=runner.lora.count,
            kv_bytes_per_token=runner.pool.layout.bytes_per_slot,
        )
        rows.append(row)
    _print_storage_ratios(rows)
    return rows


def _each(setups: dict, batch_sizes: list[int]) -> list:
    return [(setup, bs) for setup in setups.items() for bs in batch_sizes]


def _print_storage_ratios(rows: list[dict]) -> None:
    """Each setup's decode step and tokens per pool byte against the first storage's, at
    the same batch size (kept in its row for the JSONL); the LoRA runner's is its step
    against the plain one's."""
    first = {}
    for row in rows:
        base = first.setdefault(row["batch_size"], row)
        if base is row:
            continue
        row["decode_latency_vs_first_storage"] = step = (
            row["median_decode_latency"] / base["median_decode_latency"]
        )
        row["tokens_per_byte_vs_first_storage"] = room = (
            base["kv_bytes_per_token"] / row["kv_bytes_per_token"]
        )
        print(
            f"{row['setup']} / {base['setup']}, batch size "
            f"{row['batch_size']}: decode step {step:.3f}x, tokens in the same memory {room:.2f}x"
        )


def _compare_with_mlx_lm(model, rows: list[dict], args: argparse.Namespace) -> None:
    prefix_ids = _prefix_ids(args)
    for row in rows:
        prompts = _prompts(row["batch_size"], args)
        base = mlx_lm_decode_step(model, [prefix_ids + p for p in prompts], args.output_len)
        row["mlx_lm_median_decode_latency"] = base
        row["decode_ratio_vs_mlx_lm"] = row["median_decode_latency"] / base
        print(
            f"mlx-lm decode step, batch size {row['batch_size']}: {base:.5f} s; "
            f"radix-mlx / mlx-lm = {row['decode_ratio_vs_mlx_lm']:.3f}"
        )


def _header(tag: str, bs: int, args: argparse.Namespace, kv_dtype: str = "auto") -> str:
    return (
        f"--- {tag}: batch size {bs}, input {args.input_len} "
        f"(+{args.cached_prefix_len} cached), output {args.output_len}, KV {kv_dtype}"
    )


def _prefix_ids(args: argparse.Namespace) -> list[int]:
    key = mx.random.key(args.seed)
    return mx.random.randint(3, 300, (args.cached_prefix_len,), key=key).tolist()


def _cached_prefix(runner, slots: SlotList, args: argparse.Namespace) -> list[int]:
    """The slots of the --cached-prefix-len tokens every prompt starts with, now in the pool."""
    prefix_ids = _prefix_ids(args)
    if not prefix_ids:
        return []
    prefix_slots = slots.take(len(prefix_ids))
    req = ExtendReq("prefix", prefix_ids, [], prefix_slots, GREEDY, last_chunk=False)
    runner.extend(ExtendBatch(0, [req]))
    return prefix_slots


def _prompts(bs: int, args: argparse.Namespace) -> list[list[int]]:
    return [
        mx.random.randint(3, 300, (args.input_len,), key=mx.random.key(i)).tolist()
        for i in range(bs)
    ]


def _print_scaling(rows: list[dict]) -> None:
    """Decode throughput of each batch size against the first one's: printed, and kept in
    its row (`decode_throughput_vs_first_batch`) for the JSONL; with --compare-mlx-lm,
    mlx-lm's own ratio beside it (`mlx_lm_decode_throughput_vs_first_batch`), since a
    faster batch 1 makes the ratio smaller. Per pool storage."""
    firsts: dict[str, dict] = {}
    for row in rows:
        first = firsts.setdefault(row["setup"], row)
        if first is row:
            continue
        ratio = row["median_decode_throughput"] / first["median_decode_throughput"]
        row["decode_throughput_vs_first_batch"] = ratio
        line = f"Decode throughput, batch size {row['batch_size']} / batch size "
        line += f"{first['batch_size']}: {ratio:.2f}x"
        if "mlx_lm_median_decode_latency" in row:
            own = _mlx_lm_throughput(row) / _mlx_lm_throughput(first)
            row["mlx_lm_decode_throughput_vs_first_batch"] = own
            line += f" (mlx-lm's own: {own:.2f}x)"
        print(line)


def _mlx_lm_throughput(row: dict) -> float:
    return row["batch_size"] / row["mlx_lm_median_decode_latency"]


def _adapters(path: str, n: int) -> list:
    """`n` seeded rank-8 adapters of the model at `path` (q_proj, v_proj, every layer)."""
    import tempfile

    from common.lora_adapters import LoraSpec
    from common.tiny_adapter import build_tiny_adapter

    root = tempfile.mkdtemp(prefix="radix-mlx-loras-")
    layers = json.loads((Path(path) / "config.json").read_text())["num_hidden_layers"]
    return [
        LoraSpec(f"l{i}", str(build_tiny_adapter(path, f"{root}/l{i}", seed=i, rank=8,
                                                 num_layers=layers)))
        for i in range(1, n + 1)
    ]  # fmt: skip


def _preset_model(preset: str):
    from common.tiny_model import ensure_tiny_model

    return ensure_tiny_model(preset=preset)


def _append_jsonl(path: str, rows: list[dict]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="model dir or HF id (default: --preset)")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--batch-size", type=int, nargs="+", default=[1])
    p.add_argument("--input-len", type=int, default=60)
    p.add_argument("--output-len", type=int, default=100)
    p.add_argument("--cached-prefix-len", type=int, default=0)
    p.add_argument("--compare-mlx-lm", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--disable-cpu-kernels", action="store_true", help="as the server flag")
    p.add_argument("--no-overlap", action="store_true", help="decode without the lookahead")
    p.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        default=["auto"],
        choices=["auto", "bf16", "fp16", "int8", "int4"],
        help="pool storages to time, in turn (as the server flag); ratios against the first",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="benchmark passes per batch size, batch sizes taken in turn; figures are the "
        "median pass (on a noisy machine one pass can be 30%% off)",
    )
    p.add_argument(
        "--loras",
        type=int,
        default=0,
        metavar="N",
        help="also time rows running N LoRA adapters in turn against plain rows",
    )
    p.add_argument("--tp-size", type=int, default=1, help="as the server flag (see ranks.py)")
    p.add_argument("--pp-size", type=int, default=1, help="as the server flag (see ranks.py)")
    p.add_argument("--verbose", action="store_true", help="print every decode step")
    p.add_argument("--result-file", default="bench_results/bench_one_batch.jsonl")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
