"""`radix-mlx replica --model-path M --listen tcp://HOST:PORT`: start, supervise, stop.

Exit status: 2 for flags that cannot work (a non-loopback --listen without CURVE keys, a
key file that cannot be read, an address in use), 1 when the model cannot be served or
the children crash-loop (--max-restarts), 0 after SIGTERM or SIGINT. The first signal
drains, as `serve` does: the replica tells its routers (state `draining`, so they route
elsewhere), refuses new requests, and stops once those in flight ended or after
--graceful-shutdown-timeout seconds, failing the rest with a 503 naming the replica; a
second signal stops at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import shutil
import signal
import tempfile
import time

import uvloop
import zmq

from common.child_process import server_title, set_title, start_resource_tracker
from common.ipc import Endpoints
from common.log import setup_logging
from common.model_identity import describe, model_identity
from common.server_args import ServerArgs
from router.metrics import Metrics
from router.replicas.replica_server import ReplicaServer, replica_args_problem
from router.serving.model_files import Refused, resolve_args
from router.serving.stop_signals import hold_stop_signals, on_loop
from router.serving.supervisor import Children, Supervisor

logger = logging.getLogger("replica")
FLUSH_WAIT = 0.1  # seconds for the last statuses and errors to leave before the sockets close
DRAIN_POLL = 0.05  # seconds between checks for the last request in flight during a drain


def run_replica(args: ServerArgs) -> int:
    setup_logging("replica", args.log_level)
    problem = replica_args_problem(args)
    if problem:
        logger.error("%s", problem)
        return 2
    set_title("replica", server_title(args.listen.rpartition(":")[2], args.model_path))
    try:
        child_args = resolve_args(args, "replica")
    except Refused as exc:
        logger.error("%s", exc)
        return exc.status
    # the tracker first: multiprocessing unblocks SIGINT and SIGTERM once it has started it
    start_resource_tracker()
    hold_stop_signals()  # until the loop takes them (router.serving.stop_signals)
    runtime_dir = tempfile.mkdtemp(prefix="radix-mlx-")
    endpoints = Endpoints.ipc(runtime_dir)
    children = Children(child_args, endpoints)
    try:
        return uvloop.run(_main(child_args, endpoints, children))
    finally:
        children.stop()
        shutil.rmtree(runtime_dir, ignore_errors=True)
        logger.info("stopped")


async def _main(args: ServerArgs, endpoints: Endpoints, children: Children) -> int:
    identity = model_identity(args.model_path)
    try:
        server = ReplicaServer(args, endpoints, identity)
    except (ValueError, zmq.ZMQError) as exc:
        logger.error("cannot listen on %s: %s", args.listen, exc)
        return 2
    stop, now = asyncio.Event(), asyncio.Event()  # the first signal, the second
    on_loop(asyncio.get_running_loop(), functools.partial(_on_signal, children, stop, now))
    children.start()
    keys = "CURVE keys" if args.curve_secret_key else "no keys: loopback only"
    logger.info("listening on %s (%s) for routers; %s", args.listen, keys, describe(identity))
    loops = [server.front_loop(), server.scheduler_loop(), server.forget_silent_routers()]
    tasks = [asyncio.create_task(c) for c in loops]
    supervisor = Supervisor(children, server.local, server, Metrics(), args.max_restarts)
    life = asyncio.create_task(_serve(server, supervisor))
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({life, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if life.done():
            return life.result()
        server.stopped(await _drain(server, args.graceful_shutdown_timeout, now))
        await asyncio.sleep(FLUSH_WAIT)
        return 0
    finally:
        hold_stop_signals()  # the clean-up after the loop is bounded: let nothing cut it
        for task in (*tasks, life, stopped):
            task.cancel()
        server.close()


def _on_signal(children: Children, stop: asyncio.Event, now: asyncio.Event, sig: int) -> None:
    """On the loop (router.serving.stop_signals): the first signal drains, the next stops now."""
    name = signal.Signals(sig).name
    children.stopping.set()  # they keep serving through a group SIGTERM until we stop them
    if stop.is_set():
        if not now.is_set():
            logger.info("%s: stopping now", name)
        now.set()
    else:
        logger.info("%s: draining (--graceful-shutdown-timeout); signal again to stop now", name)
        stop.set()


async def _drain(server: ReplicaServer, timeout: float, now: asyncio.Event) -> str:
    """Wait for the requests in flight (up to `timeout`, or the second signal); the
    reason the rest fail with."""
    server.draining()
    started = time.monotonic()
    deadline = started + timeout
    while server.owner and time.monotonic() < deadline and not now.is_set():
        await asyncio.sleep(DRAIN_POLL)
    if not server.owner:
        logger.info("drained in %.2f s", time.monotonic() - started)
    if not server.owner or now.is_set():
        return "the replica stopped"
    logger.warning("%d request(s) still running; failing them", len(server.owner))
    return (
        "the replica stopped before the request finished "
        f"(--graceful-shutdown-timeout {timeout:g} s)"
    )


async def _serve(server: ReplicaServer, supervisor: Supervisor) -> int:
    failure = await supervisor.wait_ready()
    if failure is not None:
        logger.error("start-up failed: %s", failure[1])
        server.stopped(f"start-up failed: {failure[1]}")
        await asyncio.sleep(FLUSH_WAIT)
        return 1
    server.serving()
    logger.info("ready: KV pool %d tokens; waiting for routers", server.local.ready.num_slots)
    line = await supervisor.watch()
    if line:
        logger.error("%s", line)
        return 1
    return 0
