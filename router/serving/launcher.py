"""`radix-mlx serve`: start the replicas' workers and schedulers, supervise them, serve
HTTP and ZMQ.

The launcher process is the router. Its children (`router.serving.supervisor`), a worker and a
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
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import tempfile
import time

import uvicorn
import uvloop
import zmq.asyncio

from common.child_process import StopFlag, server_title, set_title, start_resource_tracker
from common.ipc import Endpoints
from common.log import setup_logging
from common.messages import ModelIdentity
from common.model_identity import model_identity
from common.server_args import ServerArgs
from common.trace import Trace
from router.api.api_context import ApiContext
from router.api.chat_overrides import apply_chat_overrides, chat_overrides
from router.api.http_server import create_app
from router.api.served_models import SingleModel
from router.metrics import Metrics
from router.replicas.manager import RouterManager
from router.replicas.remote_replica import attach_remote_replicas
from router.replicas.replica_set import Replica, ReplicaLink, ReplicaSet
from router.replicas.routing import make_policy
from router.sdk.frontdoor import FrontDoor
from router.serving.model_files import Refused, load_tokenizer, resolve_args
from router.serving.stop_signals import hold_stop_signals, on_loop
from router.serving.supervisor import STOP_TIMEOUT, Children, Supervision, Supervisor
from router.serving.worker_group import launched_rank, launched_spec

logger = logging.getLogger("router")
DRAIN_POLL = 0.05  # seconds between checks for the last in-flight request during a drain
HTTP_SHUTDOWN_TIMEOUT = 5  # seconds uvicorn waits for responses still being written


def stop_bound(args: ServerArgs) -> float:
    """The longest `serve` or `replica` takes to exit after SIGTERM: the drain, uvicorn's
    close, then the children asked to stop and, after STOP_TIMEOUT, killed. A service
    manager must wait longer than this before its SIGKILL (deploy/: TimeoutStopSec,
    ExitTimeOut)."""
    return args.graceful_shutdown_timeout + HTTP_SHUTDOWN_TIMEOUT + 2 * STOP_TIMEOUT


def serve(args: ServerArgs) -> int:
    set_title("router", server_title(args.port, args.model_name))
    setup_logging("router", args.log_level)
    rank = launched_rank() if args.dist_hostfile else None
    try:  # a rank of a group under mlx.launch listens on nothing of `serve`'s
        template = chat_overrides(args)
        child_args = resolve_args(args, None if rank else "serve")
    except ValueError as exc:  # --chat-template, --tool-call-parser: before the model
        logger.error("%s", exc)
        return 2
    except Refused as exc:
        logger.error("%s", exc)
        return exc.status
    model_dir = child_args.model_path
    if rank:  # a machine of a group under mlx.launch that runs its rank only
        from worker_mlx.worker import run_worker

        run_worker(child_args, None, spec=launched_spec(child_args, rank))
        return 0
    # the tracker first: multiprocessing unblocks SIGINT and SIGTERM once it has started it
    start_resource_tracker()
    hold_stop_signals()  # until the loop takes them (router.serving.stop_signals)
    tokenizer = load_tokenizer(model_dir)
    apply_chat_overrides(tokenizer, args, template)
    runtime_dir = tempfile.mkdtemp(prefix="radix-mlx-")
    logger.info("runtime directory %s", runtime_dir)
    children = _replica_children(child_args, runtime_dir)
    for replica in children if _start_together(args) else children[:1]:
        replica.start()
    # the StopFlag every child shares (none with --dp-size 0: no children to tell)
    stopping = children[0].stopping if children else None
    try:
        return uvloop.run(_main(args, tokenizer, children, stopping, model_identity(model_dir)))
    finally:
        for replica in children:
            replica.stop()
        shutil.rmtree(runtime_dir, ignore_errors=True)
        logger.info("stopped")


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


class Server(uvicorn.Server):
    """uvicorn, leaving SIGINT and SIGTERM to us (`Shutdown`, on the loop): its own
    handlers run in signal context and re-raise what they caught once it stops."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class Shutdown:
    """The first signal drains, the second stops at once; before serving (the model
    loads) there is nothing to drain and the first stops. Runs on the event loop
    (`router.serving.stop_signals.on_loop`), never in a signal handler."""

    def __init__(self, manager: RouterManager, stopping: StopFlag | None, timeout: float):
        self.manager, self.stopping, self.timeout = manager, stopping, timeout
        self.server: uvicorn.Server | None = None  # set once serving
        self.signals = 0
        self.requested = asyncio.Event()  # a signal came before serving
        self.drain: asyncio.Task | None = None

    def on_signal(self, sig: int) -> None:
        self.signals += 1
        if self.stopping is not None:
            self.stopping.set()  # the children keep serving through a group SIGTERM
        name = signal.Signals(sig).name
        if self.server is None:
            if not self.requested.is_set():
                logger.info("%s: stopping (not serving yet)", name)
            self.requested.set()
        elif self.signals == 1:
            logger.info(
                "%s: draining %d request(s) for up to %g s (--graceful-shutdown-timeout); "
                "signal again to stop now", name, len(self.manager.pending), self.timeout,
            )  # fmt: skip
            self.manager.draining()
            self.drain = asyncio.create_task(self._drain())
        elif not self.server.force_exit:
            logger.info("%s: stopping now", name)
            if self.drain is not None:
                self.drain.cancel()
            self.manager.stopped("stopped")
            self.manager.fail_all("the server stopped")
            self.server.should_exit = self.server.force_exit = True

    async def _drain(self) -> None:
        started = time.monotonic()
        deadline = started + self.timeout
        while self.manager.pending and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL)
        if self.manager.pending:
            logger.warning("%d request(s) still running; failing them", len(self.manager.pending))
            self.manager.fail_all(
                f"the server stopped before the request finished "
                f"(--graceful-shutdown-timeout {self.timeout:g} s)"
            )
        else:
            logger.info("drained in %.2f s", time.monotonic() - started)
        self.manager.stopped("stopped")
        self.server.should_exit = True


async def _main(args: ServerArgs, tokenizer, children: list[Children],
                stopping: StopFlag | None, identity: ModelIdentity) -> int:  # fmt: skip
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
    shutdown = Shutdown(manager, stopping, args.graceful_shutdown_timeout)
    on_loop(asyncio.get_running_loop(), shutdown.on_signal)
    attach_remote_replicas(manager, args, identity, ctx)  # after the local ones: r{dp_size}...
    receiver = asyncio.create_task(manager.receive_loop())
    try:
        failure = await unless(shutdown.requested, _start_up(args, children, supervisor))
        if shutdown.requested.is_set():
            return 0
        if failure is not None:
            logger.error("start-up failed: %s", failure[1])
            return 1
        manager.serving()
        models = SingleModel(ApiContext(manager, tokenizer, args, metrics))
        frontdoor = open_frontdoor(args, models, ctx)
        if frontdoor is None:
            return 2
        door = asyncio.create_task(frontdoor.serve())
        server = shutdown.server = Server(http_config(args, models, metrics))
        watcher = asyncio.create_task(supervise(supervisor, server))
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
        hold_stop_signals()  # the clean-up after the loop is bounded: let nothing cut it
        receiver.cancel()
        manager.close()


def open_frontdoor(args: ServerArgs, models, ctx: zmq.asyncio.Context) -> FrontDoor | None:
    """The SDK's front door on --zmq-port; None (logged) when the port was taken while
    the model loaded (it was free before)."""
    zmq_port = args.zmq_port or args.port + 1
    try:
        return FrontDoor(f"tcp://{args.host}:{zmq_port}", models, ctx, args.api_key)
    except zmq.ZMQError as exc:
        logger.error("--zmq-port: cannot listen on %s:%d: %s", args.host, zmq_port, exc)
        return None


async def unless(event: asyncio.Event, work):
    """`work`'s result, or None as soon as `event` is set (then `work` is cancelled)."""
    task, stop = asyncio.create_task(work), asyncio.create_task(event.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task.done() else None
    finally:
        task.cancel()
        stop.cancel()


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


def http_config(args: ServerArgs, models, metrics) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(models, args, metrics),
        host=args.host,
        port=args.port,
        loop="none",
        http="httptools",
        log_level="warning",
        log_config=None,  # its loggers propagate to ours (common.log): one format
        lifespan="off",
        timeout_keep_alive=30,
        timeout_graceful_shutdown=HTTP_SHUTDOWN_TIMEOUT,
    )


async def supervise(supervisor: Supervision, server: uvicorn.Server) -> str:
    """The supervisor's give-up line, logged, ends the server."""
    line = await supervisor.watch()
    if line:
        logger.error("%s", line)
    server.should_exit = True
    return line
