"""The MLX worker process: loads the model, sizes the KV pool, and executes descriptors.

One thread owns MLX. The loop receives a descriptor, runs it, and answers with the
sampled tokens; a bad frame or a failed step is answered with a WorkerError and the loop
goes on serving.
"""

from __future__ import annotations

import logging
import traceback

from common.child_process import setup_child, wait_for_release
from common.ipc import Endpoints, ParentWatch, bind_pull, connect_push
from common.log import setup_logging
from common.messages import (
    WORKER_INBOX,
    DecodeBatch,
    ExtendBatch,
    ReleaseBatch,
    StepResult,
    WorkerError,
)
from common.protocol import ProtocolError, decode, encode, peek_step
from common.server_args import ServerArgs
from common.trace import Trace
from worker_mlx.backends.blas import preload_openblas

logger = logging.getLogger("worker")


def run_worker(args: ServerArgs, endpoints: Endpoints, router_stopping=None, release=None) -> None:
    """Process entry point; a standby (`release` given) imports, then waits for it."""
    setup_logging("worker", args.log_level)
    setup_child("worker", router_stopping, release)
    blas = preload_openblas()
    import zmq

    from worker_mlx.buffer_cache import BufferCacheBound
    from worker_mlx.loader import load_runner

    wait_for_release("worker", release)
    runner, ready = load_runner(args, blas)
    cache = BufferCacheBound()
    ctx = zmq.Context()
    inbox = bind_pull(ctx, endpoints.worker_in)
    outbox = connect_push(ctx, endpoints.scheduler_from_worker)
    outbox.send(encode(ready))
    serve(runner, inbox, outbox, Trace(args.trace_dir, "worker"), cache.after_step)


def serve(runner, inbox, outbox, trace: Trace, after_step=lambda: None) -> None:
    import zmq

    watch = ParentWatch()
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    while True:
        if not poller.poll(1000):
            if not watch.parent_alive():
                logger.info("parent process gone; exiting")
                return
            continue
        frame = inbox.recv()
        try:
            msg = decode(frame, WORKER_INBOX)
        except ProtocolError as exc:
            logger.warning("bad frame from scheduler: %s", exc)
            # the step it names, if any: the scheduler fails that step instead of waiting
            error = WorkerError(step=peek_step(frame), message=f"bad frame: {exc}")
            outbox.send(encode(error))
            continue
        step = getattr(msg, "step", -1)
        trace("recv", step, *(["ahead"] if runner.lookahead.has_step else []))
        reply = execute(runner, msg)
        trace("done", step)
        if reply is not None:
            outbox.send(encode(reply))
        runner.run_ahead()  # the next decode step computes while the scheduler works
        after_step()


def execute(runner, msg) -> StepResult | WorkerError | None:
    try:
        if isinstance(msg, ReleaseBatch):
            runner.release(msg.release)
            return None
        out = runner.extend(msg) if isinstance(msg, ExtendBatch) else runner.decode(msg)
    except Exception as exc:
        kind = "extend" if isinstance(msg, ExtendBatch) else "decode"
        logger.error("%s step %d failed: %s", kind, msg.step, exc)
        logger.debug("%s", traceback.format_exc())
        return WorkerError(step=msg.step, message=f"{kind} failed: {exc}")
    assert isinstance(msg, (ExtendBatch, DecodeBatch))
    return StepResult(
        msg.step, out.rids, out.next_token_ids, out.logprobs, out.top_logprobs,
        out.prompt_logprobs, out.accepted, out.drafts,
    )  # fmt: skip
