"""one_batch with --tp-size / --pp-size: the same benchmark as N rank processes on a
loopback ring, against one process in the same run, with the share of the decode step
the collectives take.

    python -m benchmarks.one_batch --preset small --tp-size 2 --batch-size 1 8 --rounds 2

The command first runs the one-process benchmark (the baseline), then the N ranks (this
module re-runs `benchmarks.one_batch` with MLX_RANK / MLX_HOSTFILE set, as mlx.launch
does); every rank runs the same steps, rank 0 prints and records. A decode step's
collectives cannot be timed inside the step (they run inside one lazy graph), so they are
replayed alone right after it: the same number of collectives of the same shapes, chained
(TP: two all_sums per layer; PP: the send / receive between stages and the gather of the
last stage's hidden states), timed the same way as the step.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

import mlx.core as mx

from common.distributed_plan import GroupSpec, write_loopback_hostfile
from common.ipc import free_ports
from worker_mlx.backends.blas import rank_threads
from worker_mlx.distributed import Rank, replay_collectives

STEPS = 50  # replays of a step's collectives per batch size


def in_rank() -> bool:
    return os.environ.get("MLX_RANK") is not None


def launch(argv: list[str], size: int, result_file: str) -> list[dict]:
    """The baseline, then the ranks; returns [baseline rows, group rows] compared."""
    base_argv = _without(argv, ("--tp-size", "--pp-size"))
    subprocess.run([sys.executable, "-m", "benchmarks.one_batch", *base_argv], check=True)
    baseline = _last_rows(result_file)
    run_ranks("benchmarks.one_batch", argv, size)
    group = _last_rows(result_file)
    for base, row in zip(baseline, group):
        row["decode_latency_vs_one_process"] = ratio = (
            row["median_decode_latency"] / base["median_decode_latency"]
        )
        print(
            f"batch size {row['batch_size']}: decode step {row['median_decode_latency']:.5f} s "
            f"on {size} ranks vs {base['median_decode_latency']:.5f} s in one process "
            f"({ratio:.2f}x); collectives {row['collective_seconds']:.5f} s per step, "
            f"{row['collective_share']:.0%} of it"
        )
    return [baseline, group]


def run_ranks(module: str, argv: list[str], size: int) -> None:
    """`python -m module argv` as `size` ranks on a loopback ring, with the env mlx.launch
    sets (and RANKS_DIR, a directory they share) and the cores split as the server's
    ranks split them; rank 0's output only."""
    with tempfile.TemporaryDirectory(prefix="radix-mlx-ranks-") as tmp:
        hostfile = write_loopback_hostfile(tmp, free_ports(size))
        env = dict(os.environ, MLX_HOSTFILE=hostfile, RANKS_DIR=tmp, **rank_threads(size))
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", module, *argv],
                env=dict(env, MLX_RANK=str(r)),
                stdout=None if r == 0 else subprocess.DEVNULL,
            )  # fmt: skip
            for r in range(size)
        ]
        codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"ranks exited with {codes}")


def load_rank(path: str, tp: int, pp: int):
    """(model, group, spec): this rank's share of the model, as the worker loads it."""
    from mlx_lm import load

    from worker_mlx.distributed_shard import shard_model

    group = mx.distributed.init(backend="ring", strict=True)
    spec = GroupSpec(group.rank(), tp, pp, "ring", "")
    model, _ = load(path, lazy=True)
    shard_model(model, spec, group)
    mx.eval(model.parameters())
    return model, group, spec


def collective_seconds(rank, batch: int, hidden: int, layers: int) -> float:
    """Median time of one decode step's collectives replayed alone (see the module doc)."""
    times = [replay_collectives(rank, batch, hidden, layers) for _ in range(STEPS + 2)]
    return statistics.median(times[2:])


def add_collectives(rows: list[dict], group, spec: GroupSpec, model) -> None:
    """Each row's collective time per decode step and its share of the step."""
    args, rank = model.args, Rank(spec, group, [])
    for row in rows:
        t = collective_seconds(rank, row["batch_size"], args.hidden_size, args.num_hidden_layers)
        row.update(tp_size=spec.tp, pp_size=spec.pp, collective_seconds=t,
                   collective_share=t / row["median_decode_latency"])  # fmt: skip


def _last_rows(path: str) -> list[dict]:
    """The rows the last run appended (one per batch size and storage: the last `run` ones
    with the same run id)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    run = rows[-1].get("run")
    return [r for r in rows if r.get("run") == run]


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        if a.split("=", 1)[0] in flags:
            continue
        out.append(a)
    return out
