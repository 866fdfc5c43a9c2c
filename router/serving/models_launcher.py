"""`radix-mlx serve` with several models (`--model-dir`, a repeated `--model-path`, or
the --*-model* flags): the router serves HTTP over a `ModelPool` (router.serving.model_pool),
which starts each model's scheduler+worker pair when a request or /admin/models/load asks
for it. The pinned models (else the first) load before the server listens; signals,
exit statuses and the drain are `serve`'s (router.serving.launcher). The SDK's
requests name their model as HTTP requests do (`model=`; none: the first).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import tempfile

import uvloop
import zmq.asyncio

from common.addresses import unavailable_address
from common.child_process import StopFlag, server_title, set_title, start_resource_tracker
from common.log import setup_logging
from common.server_args import ServerArgs
from router.api.chat_overrides import chat_overrides
from router.metrics import Metrics
from router.serving.launcher import Server, Shutdown, http_config, open_frontdoor, unless
from router.serving.model_files import ModelNotFound
from router.serving.model_pool import ModelPool
from router.serving.model_registry import ModelRegistry
from router.serving.stop_signals import hold_stop_signals, on_loop

logger = logging.getLogger("router")


def serve_models(args: ServerArgs) -> int:
    set_title("router", server_title(args.port, "models"))
    setup_logging("router", args.log_level)
    try:
        args.validate()
        template = chat_overrides(args)
    except ValueError as exc:
        logger.error("%s", exc)
        return 1
    problem = unavailable_address(args, "serve")
    if problem:
        logger.error("%s", problem)
        return 2
    try:
        registry = ModelRegistry.from_args(args)
    except (ValueError, ModelNotFound) as exc:
        logger.error("%s", exc)
        return 1
    start_resource_tracker()
    hold_stop_signals()  # until the loop takes them (router.serving.stop_signals)
    runtime_dir = tempfile.mkdtemp(prefix="radix-mlx-")
    logger.info("runtime directory %s; models: %s", runtime_dir, ", ".join(registry.entries))
    stopping = StopFlag(multiprocessing.get_context("spawn"))
    try:
        return uvloop.run(_main(args, registry, runtime_dir, stopping, template))
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)
        logger.info("stopped")


async def _main(args: ServerArgs, registry: ModelRegistry, runtime_dir: str,
                stopping: StopFlag, template: str | None) -> int:  # fmt: skip
    metrics = Metrics(models=True)
    pool = ModelPool(registry, args, metrics, runtime_dir, stopping, template)
    shutdown = Shutdown(pool, stopping, args.graceful_shutdown_timeout)
    on_loop(asyncio.get_running_loop(), shutdown.on_signal)
    tasks: list[asyncio.Task] = []
    ctx = zmq.asyncio.Context()  # the SDK front door's (each model has its own)
    try:
        failure = await unless(shutdown.requested, pool.start())
        if shutdown.requested.is_set():
            return 0
        if failure is not None:
            logger.error("start-up failed: %s", failure)
            return 1
        frontdoor = open_frontdoor(args, pool, ctx)
        if frontdoor is None:
            return 2
        tasks = [asyncio.create_task(pool.keep()), asyncio.create_task(frontdoor.serve())]
        server = shutdown.server = Server(http_config(args, pool, metrics))
        logger.info("serving HTTP on http://%s:%d and the SDK on %s (%d models)", args.host,
                    args.port, frontdoor.address, len(registry.entries))  # fmt: skip
        await server.serve()
        return 0 if server.started else 1
    finally:
        hold_stop_signals()  # the clean-up after the loop is bounded: let nothing cut it
        for task in tasks:
            task.cancel()
        await pool.close()
        ctx.destroy(linger=0)
