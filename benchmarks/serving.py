"""Serving benchmark: radix-mlx side by side with mlx_lm.server on the same prompts.

    python -m benchmarks.serving --backend all --workload generated-shared-prefix \
        --preset small --max-concurrency 8
    python -m benchmarks.serving --suite standard        # what `make bench` runs
    python -m benchmarks.serving --suite speculative     # n-gram speculation vs none
    python -m benchmarks.serving --suite agent-sessions  # the disk tier (agent_sessions.py)

An asyncio load generator speaking the OpenAI HTTP API (or radix-mlx's ZMQ SDK with
`--transport sdk`). It starts each backend itself on free loopback ports (or uses
`--base-url`), sends every backend identical prompts, and measures on the client side:
TTFT is the time to the first chunk that carries a token. Results go to stdout (one
SGLang-style table per run and a comparison with ratios against mlx_lm.server), to
bench_results/serving.jsonl (one line per run) and to PNG plots in bench_results/.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

import httpx
import uvloop

from benchmarks import agent_sessions
from benchmarks.conversations import ChatSender, ResponsesSender
from benchmarks.peers import PEER_BACKENDS, PEERS, install_peers, peer_server, with_peers
from benchmarks.records import INPROCESS, RunResult, WorkloadSpec
from benchmarks.replay import InProcessEngine
from benchmarks.report import (
    CpuMeter,
    append_jsonl,
    compute_metrics,
    format_table,
    held_first_tokens,
    jsonl_row,
)
from benchmarks.summary import report
from benchmarks.transports import HttpSender, SdkSender
from benchmarks.workloads import (
    WORKLOADS,
    Progress,
    PromptFactory,
    build_sessions,
    run_sessions,
    spec_from_args,
    speculative_suite,
    standard_suite,
)
from common.ipc import free_ports
from common.server_process import ServerProcess
from common.tiny_presets import PRESETS
from router.serving.model_files import load_tokenizer
from worker_mlx.backends.blas import OPENBLAS_PATHS

BACKENDS = ("radix-mlx", "radix-mlx-no-cache", "mlx-lm", "radix-mlx-ngram", "radix-mlx-draft",
            "radix-mlx-chat", "radix-mlx-responses", *agent_sessions.BACKENDS, *PEERS,
            INPROCESS)  # fmt: skip
ALIASES = {"mlx_lm.server": "mlx-lm"}
# radix-mlx spoken to through the chat or the Responses API (benchmarks.conversations)
CONVERSATION_SENDERS = {"radix-mlx-chat": ChatSender, "radix-mlx-responses": ResponsesSender}
RADIX_MLX = str(Path(sys.executable).parent / "radix-mlx")
# mlx_lm.server with OpenBLAS loaded first, as radix-mlx's worker does: same BLAS for both.
MLX_LM_MAIN = (
    "from worker_mlx.backends.blas import preload_openblas; preload_openblas(); import runpy; "
    "runpy.run_module('mlx_lm.server', run_name='__main__', alter_sys=True)"
)


@dataclass
class Endpoint:
    """A running server: which kind it is (decides the prompt form) and where it listens."""

    backend: str
    url: str
    zmq_address: str | None = None
    pid: int | None = None  # a server the bench started: its CPU is not "other work"
    model: str = ""  # the model path, for a peer that wants it named in every request
    engine: InProcessEngine | None = None  # INPROCESS: scheduler and worker in this process


# each suite's loads; agent-sessions is sized by its --as-* flags
SUITES = {"standard": lambda args: standard_suite(),
          "speculative": lambda args: speculative_suite(),
          "agent-sessions": agent_sessions.suite}  # fmt: skip


@dataclass
class PlannedRun:
    backend: str
    spec: WorkloadSpec
    max_concurrency: int | None
    loop: bool = False  # on the preset's looping build (see `SuiteLoad`)


# --------------------------------------------------------------------------- servers


class ManagedServer(ServerProcess):
    """A backend the bench starts on free loopback ports and always stops."""

    def __init__(self, backend: str, model: str, log_dir: Path, extra: list[str]):
        self.backend, self.model = backend, model
        self.port, self.zmq_port = free_ports(2)
        self.hf_cache = tempfile.mkdtemp(prefix="bench-hf-")  # mlx_lm.server needs one offline
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=self.hf_cache)
        # fmt: off
        if backend == "mlx-lm":
            cmd = [sys.executable, "-c", MLX_LM_MAIN, "--model", model,
                   "--host", "127.0.0.1", "--port", str(self.port)]
        elif backend in PEERS:
            cmd, blas = peer_server(PEERS[backend], model, self.port)
            # a HOME of its own: vllm-mlx saves its prefix cache under ~/.cache at exit and
            # loads it at the next start, which would carry prompts into a fresh server
            env.update(blas, HOME=self.hf_cache)
        else:
            cmd = [RADIX_MLX, "serve", "--model-path", model, "--port", str(self.port),
                   "--zmq-port", str(self.zmq_port), *extra]
            if backend == "radix-mlx-no-cache":
                cmd.append("--disable-radix-cache")
            if backend == "radix-mlx-ngram":
                cmd += ["--speculative-algorithm", "ngram"]
            if backend in agent_sessions.DISK_TIER_BACKENDS:  # removed with the HF cache
                cmd += ["--kv-disk-dir", os.path.join(self.hf_cache, "kv-disk")]
        # fmt: on
        url = f"http://127.0.0.1:{self.port}"
        super().__init__(cmd, url, log_dir / f"{backend}.log", env)

    @property
    def endpoint(self) -> Endpoint:
        zmq = f"tcp://127.0.0.1:{self.zmq_port}" if self.backend not in PEER_BACKENDS else None
        pid = self.proc.pid if self.proc is not None else None
        return Endpoint(self.backend, self.url, zmq, pid, self.model)

    def ready(self) -> bool:
        """A peer may have no /health: its model list answering is as good."""
        if self.backend not in PEERS:
            return super().ready()
        try:
            return httpx.get(self.url + "/v1/models", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def start(self, timeout: float = 300) -> Endpoint:
        try:
            super().start(timeout)
        except RuntimeError as exc:
            raise RuntimeError(f"{self.backend}: {str(exc)[-4000:]}") from None
        return self.endpoint

    def stop(self) -> int:
        code = super().stop()
        shutil.rmtree(self.hf_cache, ignore_errors=True)
        return code


# --------------------------------------------------------------------------- runs


def make_sender(ep: Endpoint, transport: str, connections: int):
    if ep.engine is not None:
        return ep.engine.sender()
    if ep.backend in CONVERSATION_SENDERS:
        return CONVERSATION_SENDERS[ep.backend](ep.url, connections)
    if transport == "sdk":
        if ep.backend in PEER_BACKENDS or not ep.zmq_address:
            raise ValueError("--transport sdk needs a radix-mlx backend and its ZMQ address")
        return SdkSender(ep.zmq_address)
    text = ep.backend in PEER_BACKENDS
    peer = PEERS.get(ep.backend)
    body = {"model": ep.model} if peer is not None and peer.needs_model_field else None
    return HttpSender(ep.url, text_prompts=text, connections=connections, sampling=body)


async def bench_run(
    ep: Endpoint,
    transport: str,
    spec: WorkloadSpec,
    tokenizer,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    seed: int | str = 0,
    progress: bool = True,
    info: dict | None = None,
    wave: int | None = None,
) -> RunResult:
    """One workload against one endpoint. Same seed and load, same prompts on every backend;
    another load (even the same workload at another concurrency) shares no prefix with it.
    `wave`: only the first turns of the first `wave` sessions (a warm-up)."""
    load = f"{spec.key()} c{max_concurrency} r{request_rate}"
    factory = PromptFactory(tokenizer, f"{seed}:{load}")
    sessions = build_sessions(spec, factory)
    if wave is not None:
        sessions = [replace(s, turns=s.turns[:1]) for s in sessions[:wave]]
    transport = {"mlx-lm": "http", **dict.fromkeys(PEERS, "http"), INPROCESS: "none"}.get(
        ep.backend, transport
    )
    sender = make_sender(ep, transport, max_concurrency or len(sessions) + 1)
    meter = CpuMeter([os.getpid()] + ([ep.pid] if ep.pid else []))
    bar = Progress(sum(len(s.turns) for s in sessions), f"{ep.backend} {spec.name}", progress)
    try:
        text = ep.backend in PEER_BACKENDS
        reqs, dur = await run_sessions(
            sessions, sender, factory, text, max_concurrency, request_rate, seed, bar
        )
    finally:
        bar.close()
        await sender.close()
    if ep.engine is not None:
        info = dict(info or {}, **ep.engine.take_step_stats())
    held = held_first_tokens(tokenizer, reqs)
    foreign = meter.foreign_cores() if ep.pid else None
    info = dict(info or {}, first_token_held_by_mlx_lm=held, foreign_cpu_cores=foreign)
    return RunResult(ep.backend, transport, spec, max_concurrency, request_rate, dur, reqs, info)


WARM_UP_SEED = "warm-up"  # no load's seed: the warm-up's prompts are none of the load's


async def warm_up(
    ep: Endpoint, transport: str, tokenizer, n: int, load: PlannedRun | None = None
) -> None:
    """A few short unrelated requests so lazy loading and first-call costs are not measured;
    with `load`, on a radix-mlx server, that load's first wave instead: the first turns of
    as many of its sessions as it runs at once, on other prompts, at its concurrency. So
    the first run of the load's shapes is not measured either: the worker's fused kernels
    for them (mlx's CPU backend builds each with g++ on first use, cached under
    $TMPDIR/mlx: with that cache empty, the shared-prefix load measured 72 tok/s without
    this wave, 476 with it) and its compiled steps. A peer keeps the short requests alone:
    the wave left in its prefix cache made the best peer's shared-prefix run 0.93x."""
    if n <= 0 or (load is not None and load.backend in PEER_BACKENDS):
        return
    if load is None:
        short = dict(num_prompts=n, input_len=16, output_len=4, range_ratio=1.0)
        spec, conc, wave = WorkloadSpec("random", short), n, None
    else:
        spec, conc = load.spec, load.max_concurrency
        wave = conc or 8
    run = await bench_run(
        ep, transport, spec, tokenizer, conc, seed=WARM_UP_SEED, progress=False, wave=wave
    )
    bad = [r.error for r in run.requests if not r.ok]
    if bad:
        raise RuntimeError(f"{ep.backend} failed its warm-up request: {bad[0]}")


# --------------------------------------------------------------------------- plan and CLI


def plan_runs(args: argparse.Namespace) -> list[PlannedRun]:
    """The suite's runs, or the one workload from the flags on each chosen backend."""
    if args.suite:
        suite = SUITES[args.suite](args)
        return [
            PlannedRun(b, load.spec, c, load.loop)
            for load in suite
            for b in with_peers(load.backends, args.peers)
            for c in load.concurrencies
        ]
    backends = BACKENDS[:3] if args.backend == ["all"] else tuple(args.backend)
    spec = spec_from_args(args)
    concs = args.max_concurrency or [None]
    if spec.name == agent_sessions.WORKLOAD:
        for c in concs:
            agent_sessions.check_fits(spec.params, c)
    return [PlannedRun(b, spec, c, args.loop) for b in backends for c in concs]


def machine_info(model: str, args: argparse.Namespace) -> dict:
    """What the numbers were measured on, stored with every JSONL line."""
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in _cpuinfo() if ln.startswith("model name")), ""
    )
    blas = next((p for p in OPENBLAS_PATHS if os.path.exists(p)), "mlx bundled BLAS")
    versions = {pkg: _version(pkg) for pkg in ("mlx", "mlx-lm", "radix-mlx")}
    return {
        "model": model,
        "preset": args.preset,
        "seed": args.seed,
        "blas": blas,
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, {cpu}",
        "versions": versions,
    }


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "?"


def resolve_model(args: argparse.Namespace, loop: bool | None = None) -> str:
    if args.model_path:
        return args.model_path
    from common.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model(preset=args.preset, loop=args.loop if loop is None else loop))


async def run_backend(
    backend: str, runs: list[PlannedRun], args, model: str, tokenizer, info: dict, repeat: int = 0
) -> list[tuple[RunResult, dict]]:
    """Start (or reach) one backend, run its share of the plan, always stop it. Repeat k
    sends other prompts (seed + k), the same on every backend."""
    server = None
    if backend == INPROCESS:
        print(f"starting {backend}: scheduler and worker in this process", flush=True)
        server = InProcessEngine(model, args.server_args)
        ep = Endpoint(backend, "in-process", model=model, engine=server)
    elif args.base_url:
        ep = Endpoint(backend, args.base_url.rstrip("/"), args.zmq_address)
    else:
        # the workload's pool size first: --server-args can override it
        extra = agent_sessions.server_flags(backend, runs[0].spec) + list(args.server_args)
        if backend == "radix-mlx-draft":
            extra += ["--speculative-algorithm", "draft"]
            extra += ["--speculative-draft-model-path", args.draft_model_path]
        server = ManagedServer(backend, model, Path(args.output_dir) / "logs", extra)
        print(f"starting {backend}: {shlex.join(server.cmd)}", flush=True)
        ep = await asyncio.to_thread(server.start)
    opts = dict(
        request_rate=args.request_rate, seed=args.seed + repeat, progress=not args.no_progress
    )
    out = []
    try:
        await warm_up(ep, args.transport, tokenizer, args.warmup_requests)
        for pr in runs:
            await warm_up(ep, args.transport, tokenizer, args.warmup_requests, pr)
            run = await bench_run(
                ep, args.transport, pr.spec, tokenizer, pr.max_concurrency, info=info, **opts
            )
            run.repeat = repeat
            m = compute_metrics(run)
            print(format_table(run, m), flush=True)
            append_jsonl(Path(args.result_file), jsonl_row(run, m))
            out.append((run, m))
    finally:
        if server is not None:
            server.stop()
    return out


async def run_plan(
    plan: list[PlannedRun], args, model: str, tokenizer
) -> list[tuple[RunResult, dict]]:
    info = machine_info(model, args)
    results = []
    for repeat in range(args.repeats):
        if args.repeats > 1:
            print(f"\n=== repeat {repeat + 1} of {args.repeats}", flush=True)
        backends = list(dict.fromkeys(pr.backend for pr in plan))
        for backend in backends[::-1] if repeat % 2 else backends:  # ABBA: drift cancels
            mine = [pr for pr in plan if pr.backend == backend]
            results += await run_backend(backend, mine, args, model, tokenizer, info, repeat)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a(
        "--suite",
        choices=sorted(SUITES),
        help="the issues' target runs (standard: on the small model; speculative: on the "
        "medium one, see workloads.speculative_suite; agent-sessions: the disk tier, see "
        "benchmarks/agent_sessions.py)",
    )
    a(
        "--peers",
        nargs="+",
        choices=PEER_BACKENDS,
        default=list(PEER_BACKENDS),
        help="with --suite standard: the peers measured beside radix-mlx (each installed "
        "once into .cache/peers/, see benchmarks/peers.py; mlx-lm is mlx_lm.server)",
    )
    a(
        "--backend",
        type=lambda b: ALIASES.get(b, b),
        choices=[*BACKENDS, "all"],
        nargs="+",
        default=["radix-mlx"],
        help="one or more, run in turn (ABBA with --repeats)",
    )
    a("--draft-model-path", help="radix-mlx-draft: the draft model")
    a("--base-url", help="use a running server (of --backend's kind) instead of starting one")
    a("--zmq-address", help="with --base-url and --transport sdk: the SDK front door")
    a("--transport", choices=["http", "sdk"], default="http", help="for radix-mlx backends")
    a("--model-path", help="any mlx-lm model directory (default: build --preset offline)")
    a("--preset", choices=sorted(PRESETS), help="default: medium with --suite speculative, "
      "whose decode step is bound by reading weights as on a Mac; else small")  # fmt: skip
    a("--loop", action="store_true", help="the preset built so its greedy outputs cycle")
    a("--server-args", type=shlex.split, default=[], help="extra `radix-mlx serve` flags")
    a("--dp-size", type=int, default=1, help="radix-mlx replicas (`radix-mlx serve --dp-size`)")
    a("--replica", action="append", default=[], help="a remote replica to attach (repeatable)")
    a("--tp-size", type=int, default=1, help="radix-mlx's worker as tensor-parallel ranks")
    a("--pp-size", type=int, default=1, help="radix-mlx's worker as pipeline-parallel ranks")
    a("--workload", choices=WORKLOADS, default="random")
    a("--num-prompts", type=int, default=64, help="random workload")
    a("--random-input-len", type=int, default=256)
    a("--random-output-len", type=int, default=64)
    a("--random-range-ratio", type=float, default=1.0, help="lengths uniform in [len*r, len]")
    a("--gsp-num-groups", type=int, default=4)
    a("--gsp-prompts-per-group", type=int, default=8)
    a("--gsp-system-prompt-len", type=int, default=1024)
    a("--gsp-question-len", type=int, default=64)
    a("--gsp-output-len", type=int, default=32)
    a("--mtn-tenants", type=int, default=16, help="multi-tenant workload")
    a("--mtn-requests-per-tenant", type=int, default=8)
    a("--mtn-system-len", type=int, default=1024)
    a("--mtn-question-len", type=int, default=32)
    a("--mtn-output-len", type=int, default=16)
    a("--mt-conversations", type=int, default=8)
    a("--mt-turns", type=int, default=4)
    a("--mt-user-len", type=int, default=64)
    a("--mt-output-len", type=int, default=32)
    a(
        "--mt-history",
        choices=["ids", "text"],
        default="ids",
        help="carry answers as their exact ids, or re-tokenize their text for every backend",
    )
    a("--code-edit-text-len", type=int, default=192, help="code-edit workload")
    a("--code-edit-output-len", type=int, default=128)
    a("--repeat-len", type=int, default=2048)
    a("--repeat-output-len", type=int, default=16)
    a("--repeat-warm-runs", type=int, default=9, help="warm repeats after the cold request")
    a("--agent-sessions", type=int, default=8, help="agent workload")
    a("--agent-turns", type=int, default=6)
    a("--agent-system-len", type=int, default=1024, help="system prompt and tools, shared")
    a("--agent-task-len", type=int, default=64)
    a("--agent-result-len", type=int, default=96, help="each tool result")
    a("--agent-output-len", type=int, default=32)
    agent_sessions.add_arguments(p)
    a("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second")
    a("--max-concurrency", type=int, nargs="*", help="one value, or several for a sweep")
    a("--seed", type=int, default=0)
    a(
        "--repeats",
        type=int,
        help="run the plan this many times (seed + k; fresh servers unless --base-url) and "
        "report medians (default: 3 with --suite, else 1)",
    )
    a(
        "--warmup-requests",
        type=int,
        default=2,
        help="short unrelated requests to each server first, then before each load its first "
        "wave on other prompts (0: no warm-up)",
    )
    a("--output-dir", default="bench_results")
    a("--result-file", default="bench_results/serving.jsonl")
    a("--no-plots", action="store_true")
    a("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.suite else 1
    args.preset = args.preset or ("medium" if args.suite == "speculative" else "small")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if "radix-mlx-draft" in args.backend and not args.draft_model_path:
        p.error("--backend radix-mlx-draft needs --draft-model-path")
    if args.dp_size > 1:
        args.server_args += ["--dp-size", str(args.dp_size)]
    for address in args.replica:
        args.server_args += ["--replica", address]
    for name in ("tp_size", "pp_size"):
        if getattr(args, name) > 1:
            args.server_args += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan, args.not_installed = install_peers(plan_runs(args))
    started = time.perf_counter()
    results = []
    for loop in dict.fromkeys(p.loop for p in plan):  # one model per build the plan uses
        mine = [p for p in plan if p.loop == loop]
        model = resolve_model(args, loop)
        names = ", ".join(dict.fromkeys(p.backend for p in mine))
        print(f"model {model}; {len(mine)} run(s) on {names}", flush=True)
        # uvloop: the load generator's CPU is taken from the server under test
        results += uvloop.run(run_plan(mine, args, model, load_tokenizer(model)))
    status = report(results, args)
    print(f"\nbenchmark wall time {time.perf_counter() - started:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
