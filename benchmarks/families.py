"""What the cache does on the 2026 model families: `python -m benchmarks.families`.

1. A hybrid model (recurrent layers beside attention; default the `small`-sized Qwen3.5
   built offline): a 2,048-token prompt's cold time to first token against the same
   prompt again, which starts from the state snapshot at its last-but-one token and
   computes one token; decode throughput at batch 8 against batch 1.
2. A sliding-window model whose layers are all local (the `small` local_swa family,
   window set to 256): the decode step at 4,096 tokens of context against the step at
   512. `--window-model` takes another, e.g. the mixed `mistral_swa`.

Both run the worker's ModelRunner in-process, with the CPU backend's kernels, no server.
Figures are medians over the steps, printed as ratios to their baseline; the two sides
of each ratio step in turn (`alternate`), so the shared machine's drift hits both.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from worker_mlx.backends.blas import preload_openblas

BLAS = preload_openblas()

import mlx.core as mx  # noqa: E402

from benchmarks.one_batch import GREEDY, SlotList  # noqa: E402
from common.messages import DecodeBatch, ExtendBatch, ExtendReq, ReleaseReq  # noqa: E402
from common.tiny_model import ensure_tiny_model  # noqa: E402
from worker_mlx.backends import select  # noqa: E402
from worker_mlx.kv_pool import MlxKVPool  # noqa: E402
from worker_mlx.model_probe import probe_layout  # noqa: E402
from worker_mlx.model_runner import ModelRunner  # noqa: E402
from worker_mlx.state_pool import StatePool  # noqa: E402


class Bench:
    """A runner over a fresh pool with slot counters; each request gets its own state."""

    def __init__(self, path: str, num_slots: int, model=None):
        from mlx_lm import load

        backend = select()
        if model is None:  # a model given is shared, its backend installed already
            model, _ = load(path)
            backend.install(model)
        self.model = model
        self.vocab = int(self.model(mx.array([[0]])).shape[-1])
        kv, states = probe_layout(self.model)
        self.runner = ModelRunner(
            self.model, MlxKVPool(kv, num_slots), self.vocab,
            prefill_step=backend.prefill_step, compile_decode=backend.compile_decode,
            states=StatePool(states, 64) if states is not None else None,
        )  # fmt: skip
        self.slots = SlotList(num_slots)
        self.state = 0
        self.step = 0

    def new_state(self) -> int:
        if self.runner.states is None:
            return 0
        self.state += 1
        return self.state

    def extend(self, reqs: list[ExtendReq]) -> float:
        self.step += 1
        start = time.perf_counter()
        self.runner.extend(ExtendBatch(self.step, reqs))
        return time.perf_counter() - start

    def decode(self, rids: list[str], steps: int) -> list[float]:
        times = []
        for _ in range(steps):
            self.step += 1
            start = time.perf_counter()
            self.runner.decode(DecodeBatch(self.step, rids, self.slots.take(len(rids))))
            times.append(time.perf_counter() - start)
        return times


def alternate(cells: dict, steps: int, warmup: int = 4) -> dict:
    """Decode step times of each (Bench, rids) in `cells`, one step of each in turn, so
    the shared machine's drift hits every side of a ratio alike."""
    times = {name: [] for name in cells}
    for _ in range(steps + warmup):
        for name, (bench, rids) in cells.items():
            times[name].extend(bench.decode(rids, 1))
    return {name: t[warmup:] for name, t in times.items()}


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % (vocab - 3) + 3 for i in range(n)]


def hybrid(path: str, prompt_len: int, rounds: int) -> dict:
    b = Bench(path, (prompt_len + 200) * (rounds + 1) * 2 + 8 * 400)
    vocab = b.vocab
    cold, warm = [], []
    for r in range(rounds + 1):  # the first round warms up
        prompt = _prompt(prompt_len, r, vocab)
        slots, snap = b.slots.take(prompt_len), b.new_state()
        req = ExtendReq(f"c{r}", prompt, [], slots, GREEDY, state_slot=b.new_state(),
                        snapshots=[[prompt_len - 1, snap]] if snap else [])  # fmt: skip
        t_cold = b.extend([req])
        b.runner.release([ReleaseReq(req.rid, flush=True)])
        again = ExtendReq(f"w{r}", prompt[-1:], slots[:-1], b.slots.take(1), GREEDY,
                          state_slot=b.new_state(), prefix_state=snap)  # fmt: skip
        t_warm = b.extend([again])
        b.runner.release([ReleaseReq(again.rid, flush=True)])
        b.state = 0  # every slot is free again
        if r:
            cold.append(t_cold)
            warm.append(t_warm)
    cells = {}
    for bs in (1, 8):  # a runner each, over the same model, stepping in turn
        d = Bench(path, bs * (128 + 40 * rounds + 8), model=b.model)
        reqs = [
            ExtendReq(
                f"d{bs}-{i}",
                _prompt(128, 100 + i, vocab),
                [],
                d.slots.take(128),
                GREEDY,
                state_slot=d.new_state(),
            )  # fmt: skip
            for i in range(bs)
        ]
        d.extend(reqs)
        cells[bs] = (d, [r.rid for r in reqs])
    steps = alternate(cells, 40 * rounds)
    throughput = {bs: bs / statistics.median(t) for bs, t in steps.items()}
    row = {
        "model": path,
        "cold_ttft_s": statistics.median(cold),
        "warm_ttft_s": statistics.median(warm),
        "decode_tok_s": throughput,
    }
    row["warm_over_cold"] = row["warm_ttft_s"] / row["cold_ttft_s"]
    row["batch8_over_batch1"] = throughput[8] / throughput[1]
    cold_ms, warm_ms = row["cold_ttft_s"] * 1e3, row["warm_ttft_s"] * 1e3
    print(
        f"hybrid {Path(path).name}: {prompt_len}-token prompt cold TTFT {cold_ms:.1f} ms,"
        f" warm {warm_ms:.2f} ms: warm/cold {row['warm_over_cold']:.3f};"
        f" decode {throughput[1]:.0f} tok/s at batch 1, {throughput[8]:.0f} at 8:"
        f" {row['batch8_over_batch1']:.2f}x"
    )
    return row


def window(path: str, window_size: int, contexts: tuple[int, int], rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        shutil.copytree(path, model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        config["sliding_window"] = window_size
        (model_dir / "config.json").write_text(json.dumps(config))
        cells, model = {}, None
        for ctx in contexts:  # a runner each, over the same model, stepping in turn
            b = Bench(str(model_dir), ctx + 24 * rounds + 8, model=model)
            model = b.model
            req = ExtendReq(f"w{ctx}", _prompt(ctx, 1, b.vocab), [], b.slots.take(ctx), GREEDY)
            b.extend([req])
            cells[ctx] = (b, [req.rid])
        step = {ctx: statistics.median(t) for ctx, t in alternate(cells, 24 * rounds).items()}
    lo, hi = contexts
    ratio = step[hi] / step[lo]
    kinds = config.get("layer_types", [])
    print(
        f"window {Path(path).name} (window {window_size}, layers {kinds}): decode step"
        f" {step[lo] * 1e3:.2f} ms at {lo} tokens, {step[hi] * 1e3:.2f} ms at {hi}: {ratio:.2f}x"
    )
    return {"model": path, "window": window_size, "step_s": step, "ratio": ratio}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hybrid-model", help="default: the small qwen3_5 tiny model")
    p.add_argument("--window-model", help="default: the small local_swa tiny model")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--result-file", default="bench_results/families.jsonl")
    args = p.parse_args(argv)
    hybrid_path = args.hybrid_model or str(ensure_tiny_model(preset="small", arch="qwen3_5"))
    window_path = args.window_model or str(ensure_tiny_model(preset="small", arch="local_swa"))
    rows = [
        hybrid(hybrid_path, args.prompt_len, args.rounds),
        window(window_path, args.window, (512, 4096), args.rounds),
    ]
    out = Path(args.result_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        for row in rows:
            f.write(json.dumps(row, default=str) + "\n")


if __name__ == "__main__":
    main()
