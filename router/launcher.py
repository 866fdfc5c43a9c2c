"""`radix-mlx serve`: start the worker and scheduler, supervise them, serve HTTP and ZMQ.

The launcher process is the router. Children are spawned (not forked: MLX and ZMQ state
must not be copied), talk over ipc sockets in a private runtime directory, and exit on
their own if this process disappears. A child that dies makes /health answer 503 for a
moment, fails in-flight requests, and the server exits non-zero.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import shutil
import signal
import sys
import tempfile
import time

import uvicorn
import uvloop

from common.ipc import Endpoints
from common.log import setup_logging
from common.server_args import ServerArgs
from common.trace import Trace
from router.frontdoor import FrontDoor
from router.http_server import create_app
from router.manager import RouterManager
from router.metrics import Metrics
from router.model_files import ModelNotFound, load_tokenizer, resolve_model_path

logger = logging.getLogger("router")
STARTUP_TIMEOUT = 900.0  # seconds for the worker to load the model and size its pool
DEATH_GRACE = 1.0  # seconds /health reports 503 before the server exits


def serve(args: ServerArgs) -> int:
    setup_logging("router", args.log_level)
    try:
        args.validate()
        model_dir = resolve_model_path(args.model_path)
    except (ValueError, ModelNotFound) as exc:
        logger.error("%s", exc)
        return 1
    if args.served_model_name is None:
        args = dataclasses.replace(args, served_model_name=args.model_path)
    child_args = dataclasses.replace(args, model_path=model_dir)
    tokenizer = load_tokenizer(model_dir)
    runtime_dir = tempfile.mkdtemp(prefix="radix-mlx-")
    endpoints = Endpoints.ipc(runtime_dir) if args.transport == "ipc" else Endpoints.tcp()
    children = _start_children(child_args, endpoints)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        return uvloop.run(_main(args, endpoints, tokenizer, children))
    except KeyboardInterrupt:
        return 0
    finally:
        _stop_children(children)
        shutil.rmtree(runtime_dir, ignore_errors=True)


def _start_children(args: ServerArgs, endpoints: Endpoints) -> dict:
    from scheduler.process import run_scheduler
    from worker_mlx.worker import run_worker

    ctx = multiprocessing.get_context("spawn")
    children = {
        "worker": ctx.Process(target=run_worker, args=(args, endpoints), name="worker"),
        "scheduler": ctx.Process(target=run_scheduler, args=(args, endpoints), name="scheduler"),
    }
    for proc in children.values():
        proc.start()
    return children


def _stop_children(children: dict) -> None:
    for proc in children.values():
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + 5
    for proc in children.values():
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(1)


def _dead_child(children: dict) -> str | None:
    for name, proc in children.items():
        if not proc.is_alive():
            return f"{name} process exited with status {proc.exitcode}"
    return None


async def _main(args: ServerArgs, endpoints: Endpoints, tokenizer, children: dict) -> int:
    metrics = Metrics()
    manager = RouterManager(
        endpoints.scheduler_in,
        endpoints.router_in,
        tokenizer,
        metrics,
        args.max_queued_requests,
        Trace(args.trace_dir, "router"),
    )
    receiver = asyncio.create_task(manager.receive_loop())
    try:
        if not await _wait_ready(manager, children):
            return 1
        zmq_port = args.zmq_port or args.port + 1
        frontdoor = FrontDoor(f"tcp://{args.host}:{zmq_port}", manager, tokenizer, args.api_key)
        door = asyncio.create_task(frontdoor.serve())
        app = create_app(manager, tokenizer, args, metrics)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            loop="none",
            http="httptools",
            log_level="warning",
            lifespan="off",
            timeout_keep_alive=30,
        )
        server = uvicorn.Server(config)
        status = {"code": 0}
        watcher = asyncio.create_task(_supervise(children, manager, server, status))
        logger.info(
            "serving HTTP on http://%s:%d and the SDK on %s",
            args.host,
            args.port,
            frontdoor.address,
        )
        await server.serve()
        watcher.cancel()
        door.cancel()
        return status["code"] if server.started else 1
    finally:
        receiver.cancel()
        manager.close()


async def _wait_ready(manager: RouterManager, children: dict) -> bool:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        try:
            await asyncio.wait_for(manager.ready_event.wait(), 0.25)
            return True
        except asyncio.TimeoutError:
            dead = _dead_child(children)
            if dead:
                logger.error("start-up failed: %s", dead)
                return False
    logger.error("start-up timed out after %.0f s", STARTUP_TIMEOUT)
    return False


async def _supervise(children: dict, manager: RouterManager, server, status: dict) -> None:
    while True:
        await asyncio.sleep(0.25)
        dead = _dead_child(children)
        if dead:
            logger.error("%s; shutting down", dead)
            manager.fail_all(dead)
            status["code"] = 1
            await asyncio.sleep(DEATH_GRACE)
            server.should_exit = True
            return
