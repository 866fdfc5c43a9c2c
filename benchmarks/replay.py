"""The in-process replay: a serving load run through the scheduler and the worker's model
runner in this one process, with no router, HTTP, ZMQ or detokenizer between them.

    python -m benchmarks.serving --backend radix-mlx radix-mlx-inprocess \
        --workload random --max-concurrency 8

`radix-mlx-inprocess` is a backend of `benchmarks.serving` like any other: the same
prompts, arrival times, concurrency and client-side clock (benchmarks.workloads), only
the requests go to `InProcessEngine.sender()` instead of a socket. One asyncio loop runs
the clients and the engine: each turn of the engine takes the requests that arrived,
asks the `Scheduler` for a batch, runs it on the worker, and hands the tokens to the
waiting clients. So the difference to `radix-mlx` over HTTP is what the serving path
costs: the router, the sockets and serialization, detokenizing and SSE, and the
scheduler-worker hop. The report sets them side by side (`serving_overhead`).

The worker is reached through ONE function, `start_worker`: the worker's internals move
(ModelRunner's construction among them), and that is the only place to follow them.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time
from collections.abc import Callable

from worker_mlx.backends.blas import preload_openblas

# Before anything imports mlx (importing this module does not): the worker's BLAS here too.
BLAS = preload_openblas()


def start_worker(args, blas: str) -> tuple[object, Callable]:
    """The worker as the server builds it, minus its socket loop: its WorkerReady and a
    function that runs one descriptor as the worker's loop does (the step, then the
    lookahead it computes while the scheduler works, then the buffer-cache bound) and
    returns the StepResult / WorkerError (None for a ReleaseBatch)."""
    from worker_mlx.buffer_cache import BufferCacheBound
    from worker_mlx.loader import load_runner
    from worker_mlx.worker import execute

    engine, ready = load_runner(args, blas)  # a runner, or a Verifier around one
    cache = BufferCacheBound(engine.runner.memory.cache)

    def step(msg):
        reply = execute(engine, msg)
        engine.run_ahead()
        cache.after_step()
        return reply

    return ready, step


def server_args(model: str, flags: list[str]):
    """`radix-mlx serve` flags as the ServerArgs the scheduler and worker are built from."""
    from common.server_args import add_command_args, args_from_namespace

    parser = argparse.ArgumentParser()
    add_command_args(parser, "serve")
    args = args_from_namespace(parser.parse_args(["--model-path", model, *flags]))
    args.validate()
    return args


class InProcessEngine:
    """Scheduler + worker driven from the benchmark's own event loop."""

    def __init__(self, model: str, flags: list[str]):
        from scheduler.scheduler import Scheduler

        self.args = server_args(model, flags)
        ready, self.step = start_worker(self.args, BLAS)
        self.sched = Scheduler(self.args, ready)
        self.streams: dict[str, asyncio.Queue] = {}
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.ids = itertools.count()
        self.decode_steps: list[float] = []  # the worker's time per decode step, seconds

    def sender(self) -> InProcessSender:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._loop())
        return InProcessSender(self)

    def submit(self, msg) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[msg.rid] = queue
        self.sched.on_request(msg)
        self.wake.set()
        return queue

    async def _loop(self) -> None:
        """Run the engine; if it fails, every waiting request fails with its error (no
        client waits for ever) and the error propagates."""
        from common.messages import ReqError

        try:
            await self._turns()
        except Exception as exc:
            for rid, queue in self.streams.items():
                queue.put_nowait(ReqError(rid, f"in-process engine: {exc!r}", "internal_error"))
            raise

    async def _turns(self) -> None:
        """Scheduler turns as SchedulerProcess.run takes them, yielding to the clients
        between steps (as a socket poll with timeout 0 would let requests in)."""
        from common.messages import DecodeBatch, ReleaseBatch

        sched = self.sched
        while True:
            batch = sched.next_batch()
            if batch is None:
                self._deliver()
                self.wake.clear()
                await self.wake.wait()
                continue
            started = time.perf_counter()
            result = self.step(batch)
            if isinstance(batch, DecodeBatch):
                self.decode_steps.append(time.perf_counter() - started)
            if not isinstance(batch, ReleaseBatch):
                sched.on_result(result)
            self._deliver()
            await asyncio.sleep(0)

    def _deliver(self) -> None:
        for out in self.sched.take_outputs():
            queue = self.streams.get(out.rid)
            if queue is not None:
                queue.put_nowait(out)

    def take_step_stats(self) -> dict:
        """The worker's median decode step over the run so far (then reset), in ms."""
        steps, self.decode_steps = self.decode_steps, []
        return {"worker_decode_step_ms": statistics.median(steps) * 1000 if steps else None}

    def stop(self) -> int:
        if self.task is not None:
            self.task.cancel()
        return 0


class InProcessSender:
    """The load generator's sender (benchmarks.transports' interface) for the engine."""

    def __init__(self, engine: InProcessEngine):
        self.engine = engine

    async def send(self, prompt, out_len: int, res, clock) -> None:
        from common.messages import GenerateReq, ReqError, SamplingParams

        rid = f"replay-{next(self.engine.ids)}"
        sampling = SamplingParams(max_new_tokens=out_len, temperature=0, ignore_eos=True)
        queue = self.engine.submit(GenerateReq(rid, list(prompt.ids), sampling))
        try:
            while True:
                out = await queue.get()
                if isinstance(out, ReqError):
                    res.error = f"{out.code}: {out.message}"[:300]
                    return
                if out.token_ids:
                    clock.tokens(res, len(out.token_ids))
                    res.output_ids += out.token_ids
                    res.streamed_tokens = (res.streamed_tokens or 0) + len(out.token_ids)
                if out.finish_reason is not None:
                    res.reported_prompt_len = out.prompt_tokens
                    res.output_len = out.completion_tokens
                    res.cached_tokens = out.cached_tokens
                    return
        finally:
            self.engine.streams.pop(rid, None)

    async def close(self) -> None:
        pass
