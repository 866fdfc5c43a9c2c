"""What reaching a replica over the network costs: one load, three routers on one machine.

    python -m benchmarks.remote_link --preset small --rounds 3 -- \
        --workload random --num-prompts 32 --max-concurrency 8

- `local`: `radix-mlx serve` with its own replica (the default --dp-size 1);
- `remote`: `radix-mlx serve --dp-size 0 --replica tcp://127.0.0.1:P` and a
  `radix-mlx replica` listening there (one more hop each way, through the replica process);
- `remote+curve`: the same with CURVE keys (the hop encrypted).
All three are started once and stay up; each round runs `benchmarks.serving --base-url`
against them in turn (A B C, A B C, ...), so the machine's noise falls on all alike.
Arguments after `--` go to `benchmarks.serving`. Prints the medians over rounds and each
remote setup's ratio to `local`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common.curve import generate_keys
from common.ipc import free_ports
from common.server_process import ServerProcess
from common.tiny_model import ensure_tiny_model
from common.tiny_presets import PRESETS

RADIX_MLX = str(Path(sys.executable).parent / "radix-mlx")
METRICS = (("TTFT p50 ms", "median_ttft_ms"), ("ITL p50 ms", "median_itl_ms"),
           ("output tok/s", "output_throughput"))  # fmt: skip


class Replica(ServerProcess):
    def ready(self) -> bool:
        return "waiting for routers" in self.log()


def start_setups(model: str, pool: list[str], work: Path) -> dict[str, list[ServerProcess]]:
    """name -> its processes (the router last), all started and ready."""
    keys = work / "keys"
    generate_keys(keys)
    replica_keys = ["--curve-secret-key", str(keys / "replica.key_secret"),
                    "--curve-authorized-keys", str(keys / "authorized")]  # fmt: skip
    router_keys = ["--curve-secret-key", str(keys / "router.key_secret"),
                   "--curve-server-key", str(keys / "replica.key")]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    setups: dict[str, list[ServerProcess]] = {}
    for name, keyed in (("local", None), ("remote", False), ("remote+curve", True)):
        procs: list[ServerProcess] = []
        port, zmq_port, listen = free_ports(3)
        serve = [RADIX_MLX, "serve", "--model-path", model, "--port", str(port),
                 "--zmq-port", str(zmq_port)]  # fmt: skip
        if keyed is not None:
            address = f"tcp://127.0.0.1:{listen}"
            cmd = [RADIX_MLX, "replica", "--model-path", model, "--listen", address, *pool]
            procs.append(Replica(cmd + (replica_keys if keyed else []), address,
                                 work / f"{name}-replica.log", env))  # fmt: skip
            serve += ["--dp-size", "0", "--replica", address, *(router_keys if keyed else [])]
        else:
            serve += pool
        procs.append(ServerProcess(serve, f"http://127.0.0.1:{port}", work / f"{name}.log", env))
        for proc in procs:
            proc.start(timeout=300)
        setups[name] = procs
    return setups


def run_once(url: str, model: str, serving_args: list[str], result: Path) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.serving", "--base-url", url, "--model-path", model,
           "--no-plots", "--no-progress", "--result-file", str(result), *serving_args]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(result.read_text().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, serving_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv \
        else (argv, [])  # fmt: skip
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", help="default: the --preset tiny model, built offline")
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-total-tokens", default="65536")
    args = p.parse_args(ours)
    model = args.model_path or str(ensure_tiny_model(preset=args.preset))
    pool = ["--max-total-tokens", args.max_total_tokens]
    with tempfile.TemporaryDirectory(prefix="radix-mlx-bench-") as tmp:
        work = Path(tmp)
        setups: dict[str, list[ServerProcess]] = {}
        try:
            setups = start_setups(model, pool, work)
            rows: dict[str, list[dict]] = {name: [] for name in setups}
            for k in range(args.rounds):
                for name, procs in setups.items():
                    row = run_once(procs[-1].url, model, serving_args, work / f"{name}-{k}.jsonl")
                    rows[name].append(row)
                    cells = ", ".join(f"{label} {row[key]:.2f}" for label, key in METRICS)
                    print(f"round {k + 1} {name}: {cells}", flush=True)
        finally:
            for procs in setups.values():
                for proc in reversed(procs):
                    proc.stop()
    report(rows)
    return 0


def report(rows: dict[str, list[dict]]) -> None:
    medians = {n: {key: statistics.median(r[key] for r in rs) for _, key in METRICS}
               for n, rs in rows.items()}  # fmt: skip
    print(f"\nmedians over {len(rows['local'])} round(s); ratio = setup / local")
    print(f"{'setup':14}" + "".join(f"{label:>22}" for label, _ in METRICS))
    for name, m in medians.items():
        cells = [f"{m[key]:.2f} ({m[key] / medians['local'][key]:.3f}x)" for _, key in METRICS]
        print(f"{name:14}" + "".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    sys.exit(main())
