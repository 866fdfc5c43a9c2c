"""Soak: N minutes of mixed traffic against a radix-mlx server, optionally killing the
worker along the way; a benchmark, not a test.

    python -m benchmarks.soak --minutes 10 --kill-worker-at 200,420

starts `radix-mlx serve` on the tiny model (or `--model-path`), runs `--concurrency`
clients that each loop over a mix of requests (greedy and sampled, short and long
prompts, streams dropped mid-way, bad requests, a shared-prefix chat), and prints per
minute: completed, failed by reason, p50/p99 TTFT and ITL, and the RSS of the router,
scheduler and worker. Each kill is timed: SIGKILL to /health 503 and back to 200, and
to the last in-flight request's error, against the model's load time. At the end it
waits for the server to go idle and reports the slots still held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.sse import aiter_sse_data
from common.ipc import free_ports
from common.server_process import ServerProcess

RADIX_MLX = str(Path(sys.executable).parent / "radix-mlx")
REQUEST_TIMEOUT = 120.0  # seconds: a request still unanswered then counts as hung
PROCESSES = ("router", "scheduler", "worker")
SHARED_PREFIX = list(range(20, 276))  # 256 tokens every chat-like request starts with


@dataclass
class Outcome:
    minute: int
    kind: str
    result: str  # ok, dropped (on purpose), rejected (a bad request's 4xx), or a failure
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    ended: float = 0.0  # monotonic time of the end


@dataclass
class Kill:
    at: float
    to_503: float | None = None
    to_200: float | None = None
    in_flight_errors: list[float] = field(default_factory=list)


def _request(rng: random.Random) -> tuple[str, dict, int | None]:
    """(kind, body, events to read before dropping the stream or None)."""
    short = [rng.randrange(3, 500) for _ in range(rng.randrange(8, 64))]
    roll = rng.random()
    if roll < 0.35:
        return "greedy", {"prompt": short, "max_tokens": rng.randrange(8, 48),
                          "temperature": 0, "stream": True}, None  # fmt: skip
    if roll < 0.55:
        return "sampled", {"prompt": short, "max_tokens": rng.randrange(8, 48),
                           "temperature": 0.8, "top_p": 0.95, "seed": rng.randrange(1000),
                           "stream": True}, None  # fmt: skip
    if roll < 0.65:
        long = [rng.randrange(3, 500) for _ in range(rng.randrange(512, 1536))]
        return "long", {"prompt": long, "max_tokens": 64, "stream": True}, None
    if roll < 0.80:
        return "dropped", {"prompt": short, "max_tokens": 200, "ignore_eos": True,
                           "stream": True}, rng.randrange(1, 20)  # fmt: skip
    if roll < 0.90:
        bad = rng.choice([{"prompt": "hi", "max_tokens": "many"}, {"prompt": [1, 99999]},
                          {"prompt": "hi", "temperature": -1}, {"prompt": []}])  # fmt: skip
        return "bad", bad, None
    tail = [rng.randrange(3, 500) for _ in range(rng.randrange(4, 32))]
    return "shared", {"prompt": SHARED_PREFIX + tail, "max_tokens": 24, "temperature": 0,
                      "stream": True}, None  # fmt: skip


async def _one(http: httpx.AsyncClient, url: str, rng: random.Random, t0: float) -> Outcome:
    kind, body, keep = _request(rng)
    started = time.monotonic()
    out = Outcome(int((started - t0) // 60), kind, "ok")
    try:
        await asyncio.wait_for(_attempt(http, url, body, out, keep, started), REQUEST_TIMEOUT)
    except asyncio.TimeoutError:
        out.result = "hung"
    except httpx.HTTPError as exc:
        out.result = f"connection: {type(exc).__name__}"
    finally:
        out.ended = time.monotonic()
    if kind == "bad" and out.result == "ok":
        out.result = "bad request accepted"
    return out


async def _attempt(http, url: str, body: dict, out: Outcome, keep: int | None, started: float):
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            out.result = _status_reason(out.kind, r)
            return
        await _read_events(r, out, keep, started)


def _status_reason(kind: str, r: httpx.Response) -> str:
    if kind == "bad" and 400 <= r.status_code < 500:
        return "rejected"
    try:
        code = r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = "?"
    return f"{r.status_code} {code}"


async def _read_events(r: httpx.Response, out: Outcome, keep: int | None, started: float):
    last, seen = started, 0
    async for data in aiter_sse_data(r):
        if not data.startswith("{"):
            continue
        event = json.loads(data)
        if "error" in event:
            out.result = f"stream error: {event['error'].get('code')}"
            return
        now = time.monotonic()
        if out.ttft is None:
            out.ttft = now - started
        else:
            out.itls.append(now - last)
        last, seen = now, seen + 1
        if keep is not None and seen >= keep:
            out.result = "dropped"
            return


async def _client(url: str, seed: int, t0: float, until: float, outcomes: list) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT) as http:
        while time.monotonic() < until:
            outcomes.append(await _one(http, url, rng, t0))


def _titled(router_pid: int) -> dict[str, psutil.Process]:
    """The server's processes by role, from their titles (radix-mlx::<role>)."""
    found = {}
    try:
        procs = [psutil.Process(router_pid), *psutil.Process(router_pid).children()]
    except psutil.NoSuchProcess:
        return found
    for proc in procs:
        try:
            title = proc.name()  # the title, as setproctitle sets it
        except psutil.Error:
            continue
        for role in PROCESSES:
            if title.split(" ", 1)[0] == f"radix-mlx::{role}":  # then its port and model
                found[role] = proc
    return found


def _rss_mib(router_pid: int) -> dict[str, float]:
    out = {}
    for role, proc in _titled(router_pid).items():
        try:
            out[role] = proc.memory_info().rss / 2**20
        except psutil.Error:
            pass
    return out


async def _health(http: httpx.AsyncClient, url: str) -> int:
    try:
        return (await http.get(url + "/health", timeout=2)).status_code
    except httpx.HTTPError:
        return 0


async def _kill_worker(url: str, router_pid: int, kill: Kill) -> None:
    worker = _titled(router_pid).get("worker")
    if worker is None:
        return
    kill.at = time.monotonic()
    worker.send_signal(signal.SIGKILL)
    async with httpx.AsyncClient() as http:
        while time.monotonic() - kill.at < 300:
            status = await _health(http, url)
            now = time.monotonic() - kill.at
            if status != 200 and kill.to_503 is None:
                kill.to_503 = now
            if status == 200 and kill.to_503 is not None:
                kill.to_200 = now
                return
            await asyncio.sleep(0.02)


async def _sampler(router_pid: int, t0: float, until: float, rss: dict) -> None:
    while time.monotonic() < until:
        rss[int((time.monotonic() - t0) // 60)] = _rss_mib(router_pid)
        await asyncio.sleep(5)


async def soak(url: str, router_pid: int, args: argparse.Namespace) -> dict:
    t0 = time.monotonic()
    until = t0 + args.minutes * 60
    outcomes: list[Outcome] = []
    rss: dict[int, dict[str, float]] = {}
    kills = [Kill(0.0) for _ in args.kill_worker_at]

    async def killer(at: float, kill: Kill) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        await _kill_worker(url, router_pid, kill)

    tasks = [_client(url, args.seed * 1000 + i, t0, until, outcomes)
             for i in range(args.concurrency)]  # fmt: skip
    tasks += [killer(at, k) for at, k in zip(args.kill_worker_at, kills)]
    tasks.append(_sampler(router_pid, t0, until, rss))
    await asyncio.gather(*tasks)
    for kill in kills:  # the in-flight requests' errors: those that ended failed after it
        kill.in_flight_errors = [
            o.ended - kill.at for o in outcomes
            if o.result.startswith(("503", "stream error")) and 0 <= o.ended - kill.at < 30
        ]  # fmt: skip
    idle = await _idle_state(url)
    return {"outcomes": outcomes, "rss": rss, "kills": kills, "idle": idle}


async def _idle_state(url: str, timeout: float = 30) -> dict[str, float]:
    """running, queued and held slots once nothing is sent any more (summed over the
    replicas, each series being labeled by one)."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as http:
        while True:
            text = (await http.get(url + "/metrics")).text
            values = _server_totals(text)
            if values.get("num_running_requests") == 0 or time.monotonic() > deadline:
                return values
            await asyncio.sleep(0.5)


def _server_totals(text: str) -> dict[str, float]:
    per_replica: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        name = fam.name.removeprefix("radix_mlx_")
        if name in ("num_running_requests", "num_queued_requests", "token_usage",
                    "kv_pool_capacity_tokens"):  # fmt: skip
            for sample in fam.samples:
                per_replica.setdefault(sample.labels.get("replica", ""), {})[name] = sample.value
    totals = {"num_running_requests": 0.0, "num_queued_requests": 0.0,
              "kv_pool_capacity_tokens": 0.0, "used_slots": 0.0}  # fmt: skip
    for v in per_replica.values():
        for name in ("num_running_requests", "num_queued_requests", "kv_pool_capacity_tokens"):
            totals[name] += v.get(name, 0.0)
        totals["used_slots"] += v.get("token_usage", 0.0) * v.get("kv_pool_capacity_tokens", 0.0)
    return totals


def _pct(xs: list[float], q: float) -> str:
    if not xs:
        return "-"
    xs = sorted(xs)
    return f"{xs[min(len(xs) - 1, int(q * len(xs)))] * 1000:.0f}"


def table(result: dict) -> str:
    by_minute = defaultdict(list)
    for o in result["outcomes"]:
        by_minute[o.minute].append(o)
    lines = [
        "| min | completed | dropped | rejected (bad) | failed by reason | TTFT p50/p99 ms "
        "| ITL p50/p99 ms | RSS MiB router/scheduler/worker |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for minute in sorted(by_minute):
        os_ = by_minute[minute]
        counts = Counter(o.result for o in os_)
        failed = {k: v for k, v in counts.items() if k not in ("ok", "dropped", "rejected")}
        ttft = [o.ttft for o in os_ if o.ttft is not None and o.result == "ok"]
        itl = [x for o in os_ if o.result == "ok" for x in o.itls]
        rss = result["rss"].get(minute, {})
        rss_text = "/".join(f"{rss[p]:.0f}" if p in rss else "-" for p in PROCESSES)
        failed_text = ", ".join(f"{k}: {v}" for k, v in sorted(failed.items())) or "0"
        lines.append(
            f"| {minute + 1} | {counts['ok']} | {counts['dropped']} | {counts['rejected']} | "
            f"{failed_text} | {_pct(ttft, 0.5)}/{_pct(ttft, 0.99)} | "
            f"{_pct(itl, 0.5)}/{_pct(itl, 0.99)} | {rss_text} |"
        )
    return "\n".join(lines)


def kill_report(kills: list[Kill], load: float, starts: list[float]) -> str:
    """`starts`: the children's start times from the log, the cold one first."""
    cold = starts[0] if starts else float("nan")
    lines = [f"model load: mlx_lm.load {load:.2f} s in a fresh process; the worker and "
             f"scheduler's cold start (spawn to ready) {cold:.2f} s"]  # fmt: skip
    for i, k in enumerate(kills, 1):
        errs = k.in_flight_errors
        restart = starts[i] if i < len(starts) else float("nan")
        lines.append(
            f"kill {i}: /health 503 after {k.to_503 or float('nan'):.2f} s, 200 again after "
            f"{k.to_200 or float('nan'):.2f} s ({(k.to_200 or 0) - cold:+.2f} s vs the cold "
            f"start; restart spawn to ready {restart:.2f} s); {len(errs)} in-flight "
            f"request(s) failed, the last {max(errs) if errs else float('nan'):.2f} s after "
            f"the kill"
        )
    return "\n".join(lines)


def children_start_seconds(log: str) -> list[float]:
    """From the server log: how long each start of the worker and scheduler took, from
    their spawn to the scheduler's ready report (the first one is the cold start)."""
    return [float(x) for x in re.findall(r"ready ([0-9.]+) s after their start", log)]


def model_load_seconds(model: str) -> float:
    """mlx_lm.load of the model in a fresh process, weights evaluated (imports excluded)."""
    code = (
        "from worker_mlx.backends.blas import preload_openblas; preload_openblas(); "
        "import time, mlx_lm, mlx.core as mx; t = time.perf_counter(); "
        f"m, _ = mlx_lm.load({model!r}); mx.eval(m.parameters()); "
        "print(time.perf_counter() - t)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--kill-worker-at", default="", help="seconds into the run, comma-separated")
    p.add_argument("--model-path", default=None, help="default: the tiny model")
    p.add_argument("--server-args", default="--max-total-tokens 32768")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_results", help="directory for the JSON record")
    args = p.parse_args(argv)
    args.kill_worker_at = [float(x) for x in args.kill_worker_at.split(",") if x]
    return args


def start_server(model: str | None, server_args: str, name: str):
    """A `radix-mlx serve` of `model` (the tiny default when None) on free ports, started:
    (server, model, its log, seconds to start)."""
    if model is None:
        from common.tiny_model import ensure_tiny_model

        model = str(ensure_tiny_model(Path.home() / ".cache" / "radix-mlx", preset="tiny"))
    port, zmq_port = free_ports(2)
    cmd = [RADIX_MLX, "serve", "--model-path", model, "--port", str(port),
           "--zmq-port", str(zmq_port), *server_args.split()]  # fmt: skip
    log = Path(tempfile.mkdtemp(prefix=f"{name}-")) / "server.log"
    server = ServerProcess(cmd, f"http://127.0.0.1:{port}", log)
    started = time.monotonic()
    server.start(timeout=600)
    return server, model, log, time.monotonic() - started


def save_record(out: str, name: str, record: dict) -> None:
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    path = path / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"saved {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server, model, log, start_seconds = start_server(args.model_path, args.server_args, "soak")
    try:
        result = asyncio.run(soak(server.url, server.proc.pid, args))
    finally:
        server.stop()
    load = model_load_seconds(model)
    starts = children_start_seconds(log.read_text(errors="replace"))
    idle = result["idle"]
    report = "\n".join([
        table(result),
        kill_report(result["kills"], load, starts),
        f"idle at the end: {idle['num_running_requests']:.0f} running, "
        f"{idle['num_queued_requests']:.0f} queued, {idle['used_slots']:.0f} used slots",
    ])  # fmt: skip
    print(report)
    record = {
        "args": vars(args),
        "report": report,
        "results": [[m, r, n] for (m, r), n in sorted(
            Counter((o.minute, o.result) for o in result["outcomes"]).items())],
        "rss_mib": result["rss"],
        "kills": [vars(k) for k in result["kills"]],
        "mlx_lm_load_s": load,
        "children_start_s": starts,
        "server_start_s": start_seconds,
        "idle": idle,
        "server_log": str(log),
    }  # fmt: skip
    save_record(args.out, "soak", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
