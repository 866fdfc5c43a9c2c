"""What one scheduler <-> worker process hop costs per step: `python -m benchmarks.hop`.

A spawned child plays the worker: it binds a PULL socket on an ipc endpoint, connects a
PUSH back, and answers each `DecodeBatch` (8 requests by default) with a `StepResult`,
both through common/protocol.py's codec, as the server's worker loop does. The parent
plays the scheduler and times one round trip: encode the descriptor, send, poll, receive,
decode the reply (and the child's decode, encode in between). Round trips run back to
back, then each after an idle gap (20 ms by default: the worker sleeps in its poll while
the scheduler waits for requests, and waking it is slower than catching it spinning).

For comparison the same round trip runs between two threads of one process, over ipc
and over inproc, and "codec only" is the encode and decode work with no socket at all.
The four take turns (see `measure`). Prints median and p90 in microseconds and appends a
JSON line to bench_results/hop.jsonl.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import multiprocessing
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import zmq

from common.ipc import Endpoints, ParentWatch, bind_pull, connect_push
from common.messages import (
    SCHEDULER_FROM_WORKER,
    WORKER_INBOX,
    DecodeBatch,
    ReleaseBatch,
    StepResult,
    WorkerReady,
)
from common.protocol import decode, encode

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "bench_results" / "hop.jsonl"
TOKEN = 7  # what the stand-in worker "samples"
STOP = ReleaseBatch(step=-1, release=[])  # the real worker answers none: here it means stop
READY = WorkerReady(
    num_slots=1 << 16,
    model_type="hop",
    num_layers=1,
    n_kv_heads=1,
    head_dim=1,
    dtype="float32",
    context_len=4096,
    vocab_size=32000,
    eos_token_ids=[2],
    blas="none",
)
WARMUP = 20
REPLY_TIMEOUT_MS = 10_000


# --------------------------------------------------------------------------- the worker side


def _answer(inbox: zmq.Socket, outbox: zmq.Socket, watch: ParentWatch | None) -> None:
    """The worker loop's shape: poll, receive, decode, reply with the step's tokens."""
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    while True:
        if not poller.poll(1000):
            if watch is not None and not watch.parent_alive():
                return
            continue
        msg = decode(inbox.recv(), WORKER_INBOX)
        if isinstance(msg, ReleaseBatch):
            return
        tokens = [TOKEN] * len(msg.rids)
        outbox.send(encode(StepResult(step=msg.step, rids=msg.rids, next_token_ids=tokens)))


def _worker(ctx: zmq.Context, endpoints: Endpoints, watch: ParentWatch | None) -> None:
    inbox = bind_pull(ctx, endpoints.worker_in)
    outbox = connect_push(ctx, endpoints.scheduler_from_worker)
    try:
        outbox.send(encode(READY))
        _answer(inbox, outbox, watch)
    finally:
        inbox.close()
        outbox.close()


def _child(endpoints: Endpoints) -> None:
    """Entry point of the spawned worker process."""
    ctx = zmq.Context()
    try:
        _worker(ctx, endpoints, ParentWatch())
    finally:
        ctx.term()


# --------------------------------------------------------------------------- the scheduler side


class Link:
    """The scheduler's two sockets to a worker: its reply PULL (bound) and the PUSH."""

    def __init__(self, ctx: zmq.Context, endpoints: Endpoints):
        self.ctx, self.endpoints = ctx, endpoints
        self.inbox = bind_pull(ctx, endpoints.scheduler_from_worker)
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        self.outbox: zmq.Socket | None = None

    def wait_ready(self, alive: Callable[[], bool], timeout_s: float = 120.0) -> None:
        """The worker's hello, then connect to the inbox it has bound by now."""
        deadline = time.monotonic() + timeout_s
        while not self.poller.poll(100):
            if not alive() or time.monotonic() > deadline:
                raise RuntimeError("the worker never said it was ready")
        msg = self._receive(0)
        if not isinstance(msg, WorkerReady):
            raise RuntimeError(f"expected WorkerReady, got {type(msg).__name__}")
        self.outbox = connect_push(self.ctx, self.endpoints.worker_in)

    def round_trip(self, batch: DecodeBatch) -> int:
        """Nanoseconds from encoding `batch` to its decoded StepResult."""
        assert self.outbox is not None
        t0 = time.perf_counter_ns()
        self.outbox.send(encode(batch))
        reply = self._receive(REPLY_TIMEOUT_MS)
        t1 = time.perf_counter_ns()
        if not isinstance(reply, StepResult) or reply.step != batch.step:
            raise RuntimeError(f"unexpected reply {reply!r} to step {batch.step}")
        return t1 - t0

    def stop(self) -> None:
        if self.outbox is not None:
            self.outbox.send(encode(STOP))

    def close(self) -> None:
        for sock in (self.inbox, self.outbox):
            if sock is not None:
                sock.close()

    def _receive(self, timeout_ms: int):
        if not self.poller.poll(timeout_ms):
            raise RuntimeError(f"no message from the worker within {timeout_ms} ms")
        return decode(self.inbox.recv(), SCHEDULER_FROM_WORKER)


def make_batch(step: int, batch_size: int) -> DecodeBatch:
    """A decode descriptor like the scheduler's: uuid-hex rids, one new slot per request."""
    rids = [f"{step % 997:08x}{i:024x}" for i in range(batch_size)]
    slots = [4096 + step * batch_size + i for i in range(batch_size)]
    return DecodeBatch(step=step, rids=rids, out_cache_loc=slots, lookahead=True)


@contextlib.contextmanager
def over_process() -> Iterator[Callable[[DecodeBatch], int]]:
    """A spawned worker process on ipc sockets, as in the server."""
    runtime_dir = tempfile.mkdtemp(prefix="radix-mlx-hop-")
    endpoints = Endpoints.ipc(runtime_dir)
    ctx = zmq.Context()
    link = Link(ctx, endpoints)
    proc = multiprocessing.get_context("spawn").Process(
        target=_child, args=(endpoints,), name="hop-worker", daemon=True
    )
    proc.start()
    try:
        link.wait_ready(proc.is_alive)
        yield link.round_trip
        link.stop()
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        link.close()
        ctx.term()
        shutil.rmtree(runtime_dir, ignore_errors=True)


@contextlib.contextmanager
def over_threads(transport: str) -> Iterator[Callable[[DecodeBatch], int]]:
    """The same worker loop in a second thread of this process."""
    runtime_dir = tempfile.mkdtemp(prefix="radix-mlx-hop-")
    if transport == "ipc":
        endpoints = Endpoints.ipc(runtime_dir)
    else:
        endpoints = Endpoints("", "", "inproc://hop-worker", "inproc://hop-scheduler")
    ctx = zmq.Context()
    link = Link(ctx, endpoints)
    thread = threading.Thread(target=_worker, args=(ctx, endpoints, None), daemon=True)
    thread.start()
    try:
        link.wait_ready(thread.is_alive)
        yield link.round_trip
        link.stop()
        thread.join(10)
    finally:
        link.close()
        if not thread.is_alive():
            ctx.term()
        shutil.rmtree(runtime_dir, ignore_errors=True)


@contextlib.contextmanager
def codec_only() -> Iterator[Callable[[DecodeBatch], int]]:
    """Encode and decode both messages in one thread: what any hop pays before a socket."""

    def one(batch: DecodeBatch) -> int:
        t0 = time.perf_counter_ns()
        msg = decode(encode(batch), WORKER_INBOX)
        reply = StepResult(step=msg.step, rids=msg.rids, next_token_ids=[TOKEN] * len(msg.rids))
        decode(encode(reply), SCHEDULER_FROM_WORKER)
        return time.perf_counter_ns() - t0

    yield one


MODES: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "process, ipc": over_process,
    "two threads, ipc": lambda: over_threads("ipc"),
    "two threads, inproc": lambda: over_threads("inproc"),
    "codec only, no socket": codec_only,
}


def measure(args) -> dict[str, dict[str, list[int]]]:
    """Round trip times (ns) of every mode, back to back and after an idle gap.

    The modes take turns, back-to-back rounds in `--blocks` blocks and idle rounds one
    at a time, so the machine's drift from one second to the next hits all of them alike.
    Each mode first runs untimed round trips for `--warmup-s`: the first ~0.1 s of
    round trips run slow."""
    steps = itertools.count(1)
    times: dict[str, dict[str, list[int]]] = {name: {"b2b": [], "idle": []} for name in MODES}
    with contextlib.ExitStack() as stack:
        links = {name: stack.enter_context(start()) for name, start in MODES.items()}
        for one in links.values():
            end = time.perf_counter() + args.warmup_s
            for i in itertools.count():
                if i >= WARMUP and time.perf_counter() >= end:
                    break
                one(make_batch(next(steps), args.batch_size))
        blocks = min(args.blocks, args.rounds)
        for b in range(blocks):
            n = args.rounds * (b + 1) // blocks - args.rounds * b // blocks
            for name, one in links.items():
                batches = [make_batch(next(steps), args.batch_size) for _ in range(n)]
                times[name]["b2b"] += [one(batch) for batch in batches]
        for _ in range(args.idle_rounds):
            for name, one in links.items():
                batch = make_batch(next(steps), args.batch_size)
                time.sleep(args.idle_gap_ms / 1000)
                times[name]["idle"].append(one(batch))
    return times


# --------------------------------------------------------------------------- report and CLI


def _pct(values_ns: list[int], q: float) -> float:
    """The q-quantile in microseconds (nan with nothing to measure)."""
    if not values_ns:
        return math.nan
    s = sorted(values_ns)
    if q == 0.5:
        return statistics.median(s) / 1000
    return s[min(len(s) - 1, int(q * len(s)))] / 1000


def summarize(times: dict[str, list[int]]) -> dict[str, float]:
    return {
        f"{kind}_{name}_us": _pct(times[kind], q)
        for kind in ("b2b", "idle")
        for name, q in (("p50", 0.5), ("p90", 0.9))
    }


def machine() -> str:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, {cpu}".rstrip(", ")


@contextlib.contextmanager
def _on_cpus(cpus: list[int] | None) -> Iterator[None]:
    """Pin this thread, and so everything it starts, to `cpus`; undone afterwards."""
    if not cpus:
        yield
        return
    if not hasattr(os, "sched_setaffinity"):
        raise SystemExit("--cpus needs os.sched_setaffinity (Linux)")
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2000, help="back-to-back round trips")
    p.add_argument("--idle-rounds", type=int, default=100, help="round trips after a gap")
    p.add_argument("--idle-gap-ms", type=float, default=20.0)
    p.add_argument("--batch-size", type=int, default=8, help="rids per DecodeBatch")
    p.add_argument("--warmup-s", type=float, default=0.5, help="untimed round trips first")
    p.add_argument("--blocks", type=int, default=10, help="the modes take turns this often")
    p.add_argument(
        "--cpus",
        type=int,
        nargs="+",
        help="run everything (child, threads, ZMQ's I/O threads) on these CPUs only (Linux); "
        "by default the OS places them, and a wake-up on another CPU costs more",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSONL file to append to")
    args = p.parse_args(argv)
    if min(args.rounds, args.batch_size, args.blocks) < 1 or args.idle_rounds < 0:
        p.error("--rounds, --batch-size and --blocks must be at least 1, --idle-rounds at least 0")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with _on_cpus(args.cpus):
        results = {name: summarize(t) for name, t in measure(args).items()}
    gap = f"{args.idle_gap_ms:g} ms"
    cpus = f"pinned to CPUs {args.cpus}" if args.cpus else "CPUs as the OS places them"
    print(
        f"scheduler <-> worker round trip, DecodeBatch of {args.batch_size} rids -> StepResult "
        f"(encode, send, receive, decode, both ways); {machine()}; {cpus}"
    )
    b2b, idle = f"back to back ({args.rounds})", f"after {gap} idle ({args.idle_rounds})"
    print(f"{'':24}{b2b:>22}{idle:>28}")
    print(f"{'':24}{'p50 us':>11}{'p90 us':>11}{'p50 us':>17}{'p90 us':>11}")
    for name, r in results.items():
        print(
            f"{name:24}{r['b2b_p50_us']:11.1f}{r['b2b_p90_us']:11.1f}"
            f"{r['idle_p50_us']:17.1f}{r['idle_p90_us']:11.1f}"
        )
    proc, thr = results["process, ipc"], results["two threads, ipc"]
    print(
        f"the process boundary adds (p50, process - two threads over ipc): "
        f"{proc['b2b_p50_us'] - thr['b2b_p50_us']:.1f} us back to back, "
        f"{proc['idle_p50_us'] - thr['idle_p50_us']:.1f} us after {gap} idle"
    )
    row = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": machine(),
        "batch_size": args.batch_size,
        "rounds": args.rounds,
        "idle_rounds": args.idle_rounds,
        "idle_gap_ms": args.idle_gap_ms,
        "warmup_s": args.warmup_s,
        "cpus": args.cpus,
        "modes": {
            name: {k: None if math.isnan(v) else round(v, 2) for k, v in r.items()}
            for name, r in results.items()
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


if __name__ == "__main__":
    main()
