"""The scheduler process: sockets around `Scheduler`.

Waits for the worker's pool report, tells the router it is ready, then loops: take
requests, send a batch, wait for its result while still taking requests, send its outputs.

No wait is silent: a WorkerError or an undecodable reply while a step is in flight fails
that step's requests; a step that takes longer than --watchdog-timeout is reported to the
router (WorkerHung), which kills and restarts the worker; when the router is gone, the
process exits.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time

import zmq

from common.child_process import setup_child, wait_for_release
from common.ipc import Endpoints, ParentWatch, bind_pull, connect_push
from common.log import setup_logging
from common.messages import (
    SCHEDULER_FROM_ROUTER,
    SCHEDULER_FROM_WORKER,
    BlocksLoaded,
    CacheEvicted,
    DecodeBatch,
    EmbedBatch,
    EmbedOut,
    EmbedReq,
    ExtendBatch,
    GenerateReq,
    HoldAhead,
    LoadBatch,
    LoraUpdate,
    LoraUpdated,
    ReleaseBatch,
    ReqError,
    SchedulerReady,
    TokenOutBatch,
    WorkerError,
    WorkerHung,
    WorkerReady,
)
from common.protocol import ProtocolError, decode, encode, peek_rid
from common.server_args import ServerArgs
from common.trace import Trace
from scheduler.scheduler import Scheduler

logger = logging.getLogger("scheduler")
STATS_INTERVAL = 0.5  # seconds between SchedulerStats when nothing changed (a heartbeat)
# Seconds between SchedulerStats whose only change is token_usage, which changes at every
# decode step: a message per step cost the scheduler and the router more CPU than the
# gauge's freshness is worth (a request's start and finish still send at once).
USAGE_INTERVAL = 0.05


class SchedulerProcess:
    def __init__(self, args: ServerArgs, endpoints: Endpoints):
        self.args = args
        self.ctx = zmq.Context()
        self.from_router = bind_pull(self.ctx, endpoints.scheduler_in)
        self.from_worker = bind_pull(self.ctx, endpoints.scheduler_from_worker)
        self.to_worker = connect_push(self.ctx, endpoints.worker_in)
        # each LoadBatch also goes here: the worker's reader starts it during a step
        self.to_loads = (
            connect_push(self.ctx, endpoints.worker_loads) if endpoints.worker_loads else None
        )
        self.to_router = connect_push(self.ctx, endpoints.router_in)
        self.poller = zmq.Poller()
        self.poller.register(self.from_router, zmq.POLLIN)
        self.poller.register(self.from_worker, zmq.POLLIN)
        self.watch = ParentWatch()
        self.trace = Trace(args.trace_dir, "scheduler")
        self.sched: Scheduler | None = None
        self._bet: DecodeBatch | None = None  # in flight, to be followed by a step ahead
        self._last_stats = 0.0
        self._sent_stats = None

    def run(self) -> None:
        ready = self._wait_worker_ready()
        self.sched = sched = Scheduler(self.args, ready)
        self.to_router.send(
            encode(
                SchedulerReady(
                    ready.num_slots,
                    self.args.max_running_requests,
                    sched.context_len,
                    ready.model_type,
                    ready.memory.budget if ready.memory else 0,
                    ready.memory.fixed if ready.memory else 0,
                    ready.embedding_dim,
                    ready.embedding_normalized,
                )
            )
        )
        logger.info("ready: KV pool %d tokens, context %d", ready.num_slots, sched.context_len)
        while True:
            self._poll(timeout_ms=0 if sched.busy else int(STATS_INTERVAL * 1000))
            update = sched.lora_updates.take(sched.reqs.values())
            if update is not None:
                self._update_lora(update)
                continue
            batch = sched.next_batch()
            if batch is not None:
                self._send(batch)
            self._send_outputs()  # errors and stats; tokens went out as they came
            if batch is not None and not isinstance(batch, (ReleaseBatch, LoadBatch)):
                sched.on_result(self._wait_result(batch))
                self._send_outputs()  # before the next batch is built

    def _update_lora(self, update: LoraUpdate) -> None:
        """Run a LoRA adapter's load or unload on the worker between two steps (numbered
        as one) and answer the router."""
        self.sched.step += 1
        update.step = self.sched.step
        disk = self.sched.disk
        if disk is not None and update.path:  # the files the worker is about to load
            disk.adapter_loaded(update.lora, update.path)
        self.to_worker.send(encode(update))
        answer = self.sched.lora_updates.done(update, self._wait_result(update))
        if disk is not None and (answer.error or not update.path):
            disk.adapter_loaded(update.lora, "")  # refused, or unloaded
        self.sched.adapters_changed(answer.held_delta)
        self.to_router.send(encode(answer))

    def _wait_worker_ready(self) -> WorkerReady:
        while True:
            msg = self._poll(timeout_ms=1000, want_worker=True)
            if isinstance(msg, WorkerReady):
                return msg
            if msg is not None:
                logger.warning("ignoring %s before the worker is ready", type(msg).__name__)

    def _wait_result(self, batch: ExtendBatch | DecodeBatch | EmbedBatch | LoraUpdate):
        """The step's StepResult or WorkerError; a bad frame or a WorkerError naming no
        step (the worker could not read what we sent) ends the wait as a failed step."""
        sent, reported = time.monotonic(), False
        self._bet = batch if isinstance(batch, DecodeBatch) and batch.lookahead else None
        while True:
            msg = self._poll(timeout_ms=1000, want_worker=True)
            waited = time.monotonic() - sent
            if msg is None:
                self._send_stats(self.sched.stats())  # the router's sign that we are alive
                if waited > self.args.watchdog_timeout and not reported:
                    logger.error("step %d not done after %.1f s (watchdog)", batch.step, waited)
                    self.to_router.send(encode(WorkerHung(batch.step, waited)))
                    reported = True
                continue
            step = getattr(msg, "step", None)
            if step == batch.step or (isinstance(msg, WorkerError) and step == -1):
                self.trace("result", batch.step)
                return msg
            logger.warning(
                "dropping %s for step %s while waiting for step %d",
                type(msg).__name__,
                getattr(msg, "step", "?"),
                batch.step,
            )

    def _poll(self, timeout_ms: int, want_worker: bool = False):
        """Handle router messages; return one worker message if `want_worker` and one came
        (an undecodable one as a WorkerError of no step). Worker messages that come when
        no step is in flight are logged and dropped, so none is mistaken for a later
        step's answer."""
        events = dict(self.poller.poll(timeout_ms))
        if not events and not self.watch.parent_alive():
            logger.info("parent process gone; exiting")
            sys.exit(0)
        if self.from_router in events:
            self._drain_router()
            if want_worker and self.sched is not None:
                self._during_step()
        if self.from_worker in events:
            frame = self.from_worker.recv()
            try:
                msg = decode(frame, SCHEDULER_FROM_WORKER)
            except ProtocolError as exc:
                logger.error("bad frame from worker: %s", exc)
                msg = WorkerError(step=-1, message=f"undecodable reply from the worker: {exc}")
            if isinstance(msg, BlocksLoaded) and self.sched is not None:
                self.trace("loaded", msg.step)
                self.sched.on_loaded(msg)  # answered whenever read, not as a step's result
                return None
            if want_worker:
                return msg
            logger.warning("dropping %s from the worker: no step in flight", type(msg).__name__)
        return None

    def _during_step(self) -> None:
        """Prompts that came while a step is in flight: their loads go out now (see
        `Scheduler.load_during_step`). If that step is a decode the worker was to follow
        with the next one computed ahead, the prompt's extend comes first instead: the
        LoadBatch, or else a HoldAhead, waiting in the worker's inbox when the step is
        done tells it not to (a step computed ahead would run before the extend)."""
        load = self.sched.load_during_step()
        if load is not None:
            self._send(load)
        if self._bet is not None and self.sched.waiting:
            if load is None:
                self.to_worker.send(encode(HoldAhead(self._bet.step)))
            self._bet = None

    def _send(self, batch) -> None:
        """A batch to the worker; a LoadBatch also to its disk tier's own socket, where
        the reader thread starts it even while the worker's MLX thread is in a step (the
        copy through the worker's inbox keeps its place among the steps: the worker
        installs what was read only after it came, after the releases before it)."""
        self._trace_batch(batch)  # before the send: the worker may log first
        frame = encode(batch)
        self.to_worker.send(frame)
        if isinstance(batch, LoadBatch) and self.to_loads is not None:
            try:  # (a worker that does not listen there, e.g. a group's: dropped at the HWM)
                self.to_loads.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                pass

    def _drain_router(self) -> None:
        while True:
            try:
                frame = self.from_router.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(frame, SCHEDULER_FROM_ROUTER)
            except ProtocolError as exc:
                logger.warning("bad frame from router: %s", exc)
                rid = peek_rid(frame)
                if rid is not None:
                    self.to_router.send(encode(ReqError(rid, f"bad request frame: {exc}")))
                continue
            if self.sched is not None:
                if isinstance(msg, GenerateReq):
                    self.trace("request", msg.rid)
                self.sched.on_request(msg)
            elif isinstance(msg, (GenerateReq, EmbedReq)):  # the router waits for SchedulerReady
                error = ReqError(msg.rid, "the scheduler is starting", "service_unavailable", 503)
                self.to_router.send(encode(error))

    def _trace_batch(self, batch) -> None:
        if not self.trace.enabled:
            return
        if isinstance(batch, ExtendBatch):
            self.trace("extend", batch.step, *(r.rid for r in batch.reqs))
        elif isinstance(batch, DecodeBatch):
            self.trace("decode", batch.step, *batch.rids)
        elif isinstance(batch, LoadBatch):
            self.trace("load", batch.step, *(p.req.rid for p in self.sched.loading[batch.step]))
        elif isinstance(batch, EmbedBatch):
            self.trace("embed", batch.step, *dict.fromkeys(r.rid for r in batch.rows))

    def _send_outputs(self) -> None:
        """Stats first, so a caller that sees its last token and then scrapes /metrics
        sees the state after that step; then tokens and errors."""
        sched = self.sched
        self._send_stats(sched.stats())
        for report in sched.disk.take_reports() if sched.disk is not None else []:
            self.to_router.send(encode(report))  # the disk tier's metrics
        evicted = sched.take_evicted()
        if evicted:
            self.to_router.send(encode(CacheEvicted(evicted)))
        outputs = sched.take_outputs()
        answers = (ReqError, EmbedOut, LoraUpdated)  # one message each
        tokens = [o for o in outputs if not isinstance(o, answers)]
        if tokens:
            self.trace("out", *(t.rid for t in tokens))
            self.to_router.send(encode(TokenOutBatch(tokens)))
        for other in outputs:  # errors, embeddings and refused LoRA updates
            if isinstance(other, answers):
                self.to_router.send(encode(other))

    def _send_stats(self, stats) -> None:
        """When they changed (so a scrape is current within one step; token_usage alone
        within USAGE_INTERVAL while steps run, or at the heartbeat), and every
        STATS_INTERVAL (so a restarted router-side view catches up)."""
        now, sent = time.monotonic(), self._sent_stats
        if stats == sent:
            due = now - self._last_stats >= STATS_INTERVAL
        elif sent is not None and dataclasses.replace(stats, token_usage=sent.token_usage) == sent:
            due = now - self._last_stats >= USAGE_INTERVAL
        else:
            due = True
        if due:
            self._last_stats, self._sent_stats = now, stats
            self.to_router.send(encode(stats))


def run_scheduler(
    args: ServerArgs, endpoints: Endpoints, router_stopping=None, release=None
) -> None:
    """Process entry point; a standby (`release` given) waits for it."""
    setup_logging("scheduler", args.log_level)
    setup_child("scheduler", router_stopping, release)
    wait_for_release("scheduler", release)
    SchedulerProcess(args, endpoints).run()
