"""The MLX worker process: loads the model, sizes the KV pool, and executes descriptors.

One thread owns MLX. The loop receives a descriptor, runs it, and answers with the
sampled tokens; a bad frame or a failed step is answered with a WorkerError and the loop
goes on serving.
"""

from __future__ import annotations

import logging
import time
import traceback

from common.child_process import die_with_parent, setup_child, wait_for_release
from common.distributed_plan import GROUP_BROKEN, GroupSpec
from common.ipc import Endpoints, ParentWatch, bind_pull, connect_push
from common.log import setup_logging
from common.messages import (
    RANK_INBOX,
    WORKER_INBOX,
    BlocksLoaded,
    DecodeBatch,
    EmbedBatch,
    EmbedResult,
    ExtendBatch,
    GroupInstall,
    HoldAhead,
    LoadBatch,
    LoraUpdate,
    LoraUpdated,
    ReleaseBatch,
    StepResult,
    WorkerError,
)
from common.protocol import ProtocolError, decode, encode, peek_step
from common.server_args import ServerArgs
from common.trace import Trace
from worker_mlx.backends.blas import preload_openblas

logger = logging.getLogger("worker")


def run_worker(
    args: ServerArgs, endpoints: Endpoints, router_stopping=None, release=None,
    spec: GroupSpec | None = None,
) -> None:  # fmt: skip
    """Process entry point; a standby (`release` given) imports, then waits for it. With
    `spec`, one rank of a distributed worker (worker_mlx.distributed): rank 0 talks to
    the scheduler and forwards its frames to the other ranks."""
    name = spec.name if spec is not None else "worker"
    setup_logging(name, args.log_level)
    setup_child(name, router_stopping, release)
    if spec is not None:
        die_with_parent()  # a rank waiting in a collective cannot check its parent
    blas = preload_openblas(spec.ranks_on_host if spec is not None else 1)
    import zmq

    from worker_mlx.buffer_cache import BufferCacheBound
    from worker_mlx.distributed import CollectiveProbe, Fanout, follower_inbox, join_group
    from worker_mlx.embed_pass import load_embedder
    from worker_mlx.kv_disk_open import open_tier
    from worker_mlx.loader import load_runner
    from worker_mlx.memory import StepGuard, apply_test_limits

    wait_for_release("worker", release)
    rank = join_group(spec) if spec is not None else None
    engine, ready = load_runner(args, blas, rank)  # a runner, or a Verifier around one
    runner = engine.runner
    embedder = None  # a distributed worker does not embed (the router refuses it)
    if spec is not None and spec.rank == 0:
        logger.info("embeddings off: a distributed worker does not embed")
    if spec is None:
        embedder = load_embedder(
            args.model_path, runner.model, args.pooling, runner.prefill_step, runner.vocab_size
        )
        ready.embedding_dim = embedder.dim
        ready.embedding_normalized = embedder.pooling.normalize
    ready.generates = not getattr(runner.model, "headless", False)
    drafter = getattr(getattr(engine, "proposer", None), "runner", None)  # a draft model's
    disk = open_tier(args, runner.pool, runner.states, drafter.pool if drafter else None, rank)
    if disk is not None:
        ready.disk_blocks, ready.disk_block_tokens = disk.known_keys(), disk.block_tokens
        ready.disk_window = disk.window
    # not in a group: each rank's own count could refuse a step the others run
    guard = StepGuard(runner.memory) if spec is None else None
    cache = BufferCacheBound(runner.memory.cache)
    apply_test_limits(runner.memory)
    ctx = zmq.Context()
    trace = Trace(args.trace_dir, name)
    probe = CollectiveProbe(rank, runner.model) if rank is not None else None
    if spec is not None and spec.rank > 0:
        inbox = follower_inbox(ctx, spec)
        serve(engine, inbox, None, trace, cache.after_step, probe=probe, disk=disk)
        return
    forward = Fanout(ctx, spec.fanout) if spec is not None else None
    inbox = bind_pull(ctx, endpoints.worker_in)
    outbox = connect_push(ctx, endpoints.scheduler_from_worker)
    outbox.send(encode(ready))
    if disk is not None:
        _connect_tier(disk, ctx, endpoints, trace, forward)
    serve(engine, inbox, outbox, trace, cache.after_step, forward, probe, guard, embedder, disk)


def serve(
    engine, inbox, outbox, trace: Trace, after_step=lambda: None, forward=None, probe=None,
    guard=None, embedder=None, disk=None,
) -> None:  # fmt: skip
    """`engine`: the runner, or the Verifier around it (its `runner`) that the loader
    built; `outbox` None: a rank > 0, which answers nobody; `forward(frame)`: rank 0's fan-out
    of every valid frame to the other ranks, before it runs the frame itself; `probe`: a
    distributed worker's CollectiveProbe (a rank of a group: a failed step ends it, see
    `execute`); `guard`: the memory.StepGuard checked before each step; `embedder`:
    the embed_pass.Embedder that answers EmbedBatch (None: refused); `disk`: the
    kv_disk.DiskTier (--kv-disk-dir), which saves and loads blocks and reports."""
    import zmq

    watch = ParentWatch()
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    if disk is not None and outbox is not None:
        poller.register(disk.wake_fd, zmq.POLLIN)  # the reader's: a load is read
    while True:
        _install_loads(disk, outbox, engine)  # blocks read meanwhile, between steps
        events = dict(poller.poll(1000))
        if not events:
            if not watch.parent_alive():
                logger.info("parent process gone; exiting")
                return
            continue
        if inbox not in events:
            continue  # the reader woke the loop: its load is installed at the top
        frame = inbox.recv()
        _install_loads(disk, outbox, engine)  # before any descriptor: it may use them
        try:
            msg = decode(frame, WORKER_INBOX if outbox is not None else RANK_INBOX)
        except ProtocolError as exc:
            logger.warning("bad frame from scheduler: %s", exc)
            # the step it names, if any: the scheduler fails that step instead of waiting
            if outbox is not None:
                error = WorkerError(step=peek_step(frame), message=f"bad frame: {exc}")
                outbox.send(encode(error))
            continue
        if forward is not None:
            forward(frame)
        if isinstance(msg, HoldAhead):
            continue  # it did its work waiting in the inbox (`_run_ahead`)
        step = getattr(msg, "step", -1)
        trace("recv", step, *(["ahead"] if engine.runner.lookahead.has_step else []))
        reply = execute(engine, msg, probe is not None, guard, embedder, disk)
        trace("done", step)
        if isinstance(msg, GroupInstall):
            continue  # not a step: nothing to answer, nothing new to compute ahead
        if reply is not None and outbox is not None:
            outbox.send(encode(_with_reports(reply, engine, probe, disk)))
        _follow_up(engine, msg, step, probe, probe is None and bool(inbox.poll(0)))
        after_step()


def _with_reports(reply, engine, probe, disk):
    """The reply with what rides along: the group's collective time, the disk tier's
    report, the vision tower's counts."""
    if probe is not None and isinstance(reply, StepResult):
        reply.collective_seconds = probe.take()
    if disk is not None and not isinstance(reply, WorkerError):
        reply.disk = disk.report()
    vision = engine.runner.vision
    if vision is not None and isinstance(reply, StepResult):
        reply.vision_counts = [vision.tower_runs, vision.cache_hits]
    return reply


def _follow_up(engine, msg, step: int, probe, held: bool) -> None:
    """After the reply: the group's timing of its collectives, at the same point on every
    rank, then the lookahead (`held` is always False in a group: every rank must run the
    same steps, whatever came when). Both run collectives, so a peer lost meanwhile ends
    the rank as in `execute`, not with an uncaught traceback."""
    try:
        if probe is not None:
            probe.after(msg)
        _run_ahead(engine, held)
    except Exception as exc:
        if probe is None:
            raise
        logger.error("after step %d: failed in the group (%s); exiting", step, exc)
        raise SystemExit(GROUP_BROKEN) from exc


def _run_ahead(engine, held: bool) -> None:
    """Compute the next decode step while the scheduler works, unless `held`: the
    scheduler sent something during the step just answered (HoldAhead, or a LoadBatch:
    a prompt arrived), so that step is not the likely next descriptor, and one computed
    ahead would run before the prompt's extend."""
    if held:
        engine.runner.lookahead.expect_step(None)
    engine.run_ahead()


def _install_loads(disk, outbox, engine) -> None:
    """Write the loads the reader has read into the pool (and answer those it did not).
    A finished request's kept buffer (Lookahead) is forgotten: a load may have taken its
    slots, which the buffer would otherwise be reused for."""
    if disk is None or outbox is None:
        return
    installed = disk.installed
    for answer in disk.install_ready():
        answer.disk = disk.report()
        outbox.send(encode(answer))
    lookahead = engine.runner.lookahead
    if disk.installed != installed and lookahead.bet is not None and not lookahead.has_step:
        lookahead.invalidate()


def _connect_tier(disk, ctx, endpoints: Endpoints, trace: Trace, forward) -> None:
    """The disk tier's links: loads start as soon as the scheduler sends them and are
    answered once read. A group's tier (`forward`: rank 0's Fanout) tells the ranks when
    to install a load instead, and rank 0 answers after they did, from the serving loop."""
    disk.trace = trace
    if forward is not None:
        disk.forward = forward
        return
    disk.answer_from_reader(lambda: _sender(connect_push(ctx, endpoints.scheduler_from_worker)))
    if endpoints.worker_loads:
        disk.receive_loads(lambda: _load_receiver(bind_pull(ctx, endpoints.worker_loads)))


def _sender(socket):
    return lambda msg: socket.send(encode(msg))


def _load_receiver(socket):
    """The next LoadBatch from `socket` (None: another message), for the disk tier."""

    def receive() -> LoadBatch | None:
        msg = decode(socket.recv(), WORKER_INBOX)
        return msg if isinstance(msg, LoadBatch) else None

    return receive


def execute(
    engine, msg, group: bool = False, guard=None, embedder=None, disk=None
) -> StepResult | EmbedResult | BlocksLoaded | LoraUpdated | WorkerError | None:
    """The step's result, or the error it is answered with. In a group, only a descriptor
    the checks refuse (ValueError, raised alike on every rank before any collective) is
    answered: any other failure (a peer lost mid-collective) may have left the ranks'
    states apart, so the rank exits and the supervisor restarts the whole group. `guard`:
    the worker's memory.StepGuard (None: no check before a step)."""
    try:
        if isinstance(msg, ReleaseBatch):
            engine.release(msg.release)
            if disk is not None:
                disk.save(msg.save)  # flushed just now; no later descriptor ran yet
                disk.store.touch(msg.touch)
            return None
        if isinstance(msg, LoadBatch):
            engine.release(msg.release)
            if disk is None:
                return BlocksLoaded(msg.step, 0)
            disk.submit(msg.step, msg.loads)  # answered once read (serve's loop)
            return None
        if isinstance(msg, GroupInstall):  # a rank > 0: rank 0 read that load's blocks
            disk.install_step(msg.step)
            return None
        if isinstance(msg, LoraUpdate):  # between steps: no row of an unloaded adapter runs
            return engine.runner.update_lora(msg)
        if isinstance(msg, EmbedBatch):  # no KV: the engine and its pool are not involved
            if embedder is None:
                raise ValueError("embeddings are not served by a distributed worker")
            return EmbedResult(msg.step, embedder.embed([r.input_ids for r in msg.rows]))
        ahead = engine.runner.lookahead.has_step  # then the step may already be computed
        started = time.perf_counter()
        if guard is not None and not ahead:
            guard.check(engine.runner, msg)
        out = engine.extend(msg) if isinstance(msg, ExtendBatch) else engine.decode(msg)
        took = None if ahead or isinstance(msg, ExtendBatch) else time.perf_counter() - started
    except Exception as exc:
        from worker_mlx.memory import is_out_of_memory  # mlx: not at import (blas.py)

        if is_out_of_memory(exc) and not group:
            return _out_of_memory(engine, msg, exc)
        if group and not isinstance(exc, ValueError):
            logger.error("step %d failed in the group (%s); exiting", msg.step, exc)
            raise SystemExit(GROUP_BROKEN) from exc
        kind = _kind(msg)
        logger.error("%s step %d failed: %s", kind, msg.step, exc)
        logger.debug("%s", traceback.format_exc())
        return WorkerError(step=msg.step, message=f"{kind} failed: {exc}")
    assert isinstance(msg, (ExtendBatch, DecodeBatch))
    return StepResult(
        msg.step, out.rids, out.next_token_ids, logprobs=out.logprobs,
        top_logprobs=out.top_logprobs, prompt_logprobs=out.prompt_logprobs,
        accepted=out.accepted, proposed=out.proposed, guesses=out.guesses, step_seconds=took,
    )  # fmt: skip


def _out_of_memory(engine, msg, exc: Exception) -> WorkerError:
    """The step's requests fail with a 503 and the worker goes on: the step's temporaries
    are freed, the decode buffer (the failed rows' or, for an extend, already flushed)
    dropped, and the scheduler releases the step's slots as for any failed step."""
    kind = _kind(msg)
    logger.error("%s step %d ran out of memory: %s", kind, msg.step, exc)
    engine.recover()
    text = str(exc)
    if not text.startswith("out of memory"):
        text = f"out of memory computing this step ({text})"
    return WorkerError(step=msg.step, message=text, out_of_memory=True)


def _kind(msg) -> str:
    return {ExtendBatch: "extend", EmbedBatch: "embed"}.get(type(msg), "decode")
