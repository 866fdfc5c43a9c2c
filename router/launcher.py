"""`radix-mlx serve`: start the replicas' workers and schedulers, supervise them, serve
HTTP and ZMQ.

The launcher process is the router. Its children (`router.supervisor`), a worker and a
scheduler per replica (`--dp-size`), talk over ipc sockets in a private runtime directory
(a subdirectory per replica), are restarted when they die or hang, and exit on their own
if this process disappears. With several replicas and an auto-sized pool, the first
replica sizes its pool from its share of the memory budget and the others start once it
is ready, with a pool of the same size (so do restarts). SIGTERM or SIGINT drains: new
requests get 503, in-flight ones get up to --graceful-shutdown-timeout seconds; a second
signal stops at once. Either way the children are stopped and the runtime directory removed.

Exit status: 1 with one line for a flag value or a model that cannot work, 2 for an
address it cannot listen on (both found before the model loads: `resolve_args`), 1 when
the children crash-loop (--max-restarts), 0 after SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import signal
import sys
import tempfile
import time

import uvicorn
import uvloop
import zmq.asyncio

from common.child_process import server_title, set_title, start_resource_tracker
from common.ipc import Endpoints
from common.log import setup_logging
from common.messages import ModelIdentity
from common.model_identity import model_identity
from common.server_args import ServerArgs
from common.trace import Trace
from router.frontdoor import FrontDoor
from router.http_server import create_app
from router.manager import RouterManager
from router.metrics import Metrics
from router.model_files import Refused, load_tokenizer, resolve_args
from router.remote_replica import attach_remote_replicas
from router.replicas import Replica, ReplicaLink, ReplicaSet
from router.routing import make_policy
from router.supervisor import Children, Supervision, Supervisor
from router.worker_group import launched_rank, launched_spec

logger = logging.getLogger("router")
DRAIN_POLL = 0.05  # seconds between checks for the last in-flight request during a drain
HTTP_SHUTDOWN_TIMEOUT = 5  # seconds uvicorn waits for responses still being written


def serve(args: ServerArgs) -> int:
    set_title("router", server_title(args.port, args.model_name))
    setup_logging("router", args.log_level)
    rank = launched_rank() if args.dist_hostfile else None
    try:  # a rank of a group under mlx.launch listens on nothing of `serve`'s
        child_args = resolve_args(args, None if rank else "serve")
    except Refused as exc:
        logger.error("%s", exc)
        return exc.status
    model_dir = child_args.model_path
    if rank:  # a machine of a group under mlx.launch that runs its rank only
        from worker_mlx.worker import run_worker

        run_worker(child_args, None, spec=launched_spec(child_args, rank))
        return 0
    start_resource_tracker()
    tokenizer = load_tokenizer(model_dir)
    runtime_dir = tempfile.mkdtemp(prefix="radix-mlx-")
    logger.info("runtime directory %s", runtime_dir)
    children = _replica_children(child_args, runtime_dir)
    for replica in children if _start_together(args) else children[:1]:
        replica.start()
    # what holds the `stopping` event every child shares (no processes with --dp-size 0)
    anchor = children[0] if children else Children(child_args, None)

    def stop_now(*_):  # before HTTP serves (the model loads): nothing to drain yet
        anchor.stopping.set()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop_now)
    signal.signal(signal.SIGINT, stop_now)
    try:
        return uvloop.run(_main(args, tokenizer, children, anchor, model_identity(model_dir)))
    finally:
        for replica in children:
            replica.stop()
        shutil.rmtree(runtime_dir, ignore_errors=True)


def _replica_children(args: ServerArgs, runtime_dir: str) -> list[Children]:
    """Each replica's children, with its own endpoints (and ipc subdirectory)."""
    n = args.dp_size
    out: list[Children] = []
    for i in range(n):
        if args.transport == "ipc":
            os.mkdir(path := os.path.join(runtime_dir, f"r{i}"))
            endpoints = Endpoints.ipc(path)
        else:
            endpoints = Endpoints.tcp()
        stopping = out[0].stopping if out else None
        out.append(Children(args, endpoints, f"-r{i}" if n > 1 else "", stopping))
    return out


def _start_together(args: ServerArgs) -> bool:
    """All replicas at once, unless later ones must take the first one's pool size."""
    return args.dp_size <= 1 or args.max_total_tokens is not None


class _Server(uvicorn.Server):
    """uvicorn, whose SIGINT/SIGTERM handling is ours (`Shutdown.on_signal`)."""

    def __init__(self, config: uvicorn.Config, on_signal):
        super().__init__(config)
        self.on_signal = on_signal

    def handle_exit(self, sig: int, frame) -> None:
        self.on_signal(sig)


class Shutdown:
    """The first signal drains, the second stops at once. `children`: any replica's (they
    share the `stopping` event)."""

    def __init__(self, manager: RouterManager, children: Children, timeout: float):
        self.manager, self.children, self.timeout = manager, children, timeout
        self.loop = asyncio.get_running_loop()
        self.server: uvicorn.Server | None = None
        self.signals = 0
        self.drain: asyncio.Task | None = None

    def on_signal(self, sig: int) -> None:
        self.signals += 1
        self.children.stopping.set()
        self.loop.call_soon_threadsafe(self._act, signal.Signals(sig).name)

    def _act(self, name: str) -> None:
        if self.signals == 1:
            logger.info(
                "%s: draining %d request(s) for up to %g s (--graceful-shutdown-timeout); "
                "signal again to stop now", name, len(self.manager.pending), self.timeout,
            )  # fmt: skip
            self.manager.draining()
            self.drain = asyncio.create_task(self._drain())
        else:
            logger.info("%s: stopping now", name)
            self.manager.stopped("stopped")
            self.manager.fail_all("the server stopped")
            self.server.should_exit = self.server.force_exit = True

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.timeout
        while self.manager.pending and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL)
        if self.manager.pending:
            logger.warning("%d request(s) still running; failing them", len(self.manager.pending))
            self.manager.fail_all(
                f"the server stopped before the request finished "
                f"(--graceful-shutdown-timeout {self.timeout:g} s)"
            )
        self.manager.stopped("stopped")
        self.server.should_exit = True


async def _main(args: ServerArgs, tokenizer, children: list[Children], anchor: Children,
                identity: ModelIdentity) -> int:  # fmt: skip
    metrics = Metrics()
    ctx = zmq.asyncio.Context()
    replicas = ReplicaSet([
        Replica(f"r{i}", c.endpoints.scheduler_in, ReplicaLink.local(ctx, c.endpoints))
        for i, c in enumerate(children)
    ])  # fmt: skip
    policy = make_policy(args.routing_policy, args.cache_threshold,
                         args.balance_abs_threshold, args.balance_rel_threshold)  # fmt: skip
    manager = RouterManager(replicas, tokenizer, metrics, args.max_queued_requests,
                            Trace(args.trace_dir, "router"), policy, ctx,
                            args.restart_wait_timeout)  # fmt: skip
    supervisor = Supervision([
        Supervisor(c, r, manager, metrics, args.max_restarts) for c, r in zip(children, replicas)
    ])  # fmt: skip
    attach_remote_replicas(manager, args, identity, ctx)  # after the local ones: r{dp_size}...
    receiver = asyncio.create_task(manager.receive_loop())
    try:
        failure = await _start_up(args, children, supervisor)
        if failure is not None:
            logger.error("start-up failed: %s", failure[1])
            return 1
        manager.serving()
        zmq_port = args.zmq_port or args.port + 1
        try:
            address = f"tcp://{args.host}:{zmq_port}"
            frontdoor = FrontDoor(address, manager, tokenizer, args.api_key)
        except zmq.ZMQError as exc:  # taken while the model loaded (it was free before)
            logger.error("--zmq-port: cannot listen on %s:%d: %s", args.host, zmq_port, exc)
            return 2
        door = asyncio.create_task(frontdoor.serve())
        shutdown = Shutdown(manager, anchor, args.graceful_shutdown_timeout)
        server = shutdown.server = _Server(_http_config(args, manager, tokenizer, metrics),
                                           shutdown.on_signal)  # fmt: skip
        watcher = asyncio.create_task(_supervise(supervisor, server))
        logger.info(
            "serving HTTP on http://%s:%d and the SDK on %s",
            args.host,
            args.port,
            frontdoor.address,
        )
        await server.serve()
        gave_up = watcher.done() and bool(watcher.result())
        watcher.cancel()
        door.cancel()
        return 1 if gave_up or not server.started else 0
    finally:
        receiver.cancel()
        manager.close()


async def _start_up(args: ServerArgs, children: list[Children], supervision: Supervision):
    """Every replica ready (None), else (process, why not). Later replicas that must
    take the first one's pool size start once it is ready; with several replicas every
    restart keeps the pool size the replica started with."""
    sups = supervision.supervisors
    if not _start_together(args):
        failure = await sups[0].wait_ready()
        if failure is not None:
            return failure
        size = sups[0].replica.ready.num_slots
        for c in children[1:]:
            c.args = dataclasses.replace(c.args, max_total_tokens=size)
            c.start()
    failure = await supervision.wait_ready()
    if failure is None and len(children) > 1:
        for c, sup in zip(children, sups):
            c.args = dataclasses.replace(c.args, max_total_tokens=sup.replica.ready.num_slots)
    return failure


def _http_config(args: ServerArgs, manager, tokenizer, metrics) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(manager, tokenizer, args, metrics),
        host=args.host,
        port=args.port,
        loop="none",
        http="httptools",
        log_level="warning",
        lifespan="off",
        timeout_keep_alive=30,
        timeout_graceful_shutdown=HTTP_SHUTDOWN_TIMEOUT,
    )


async def _supervise(supervisor: Supervision, server: uvicorn.Server) -> str:
    """The supervisor's give-up line, logged, ends the server."""
    line = await supervisor.watch()
    if line:
        logger.error("%s", line)
    server.should_exit = True
    return line
