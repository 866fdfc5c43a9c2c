"""`radix-mlx replica`: a scheduler+worker pair that waits for routers on --listen.

The replica process starts and supervises the same two children `radix-mlx serve` does
(`router.serving.supervisor`: restarted when they die or hang, the same --max-restarts), talks to
them over ipc as a router would, and relays frames between them and the routers that
connect to --listen.

Socket pattern: one ZMQ ROUTER socket bound at --listen, one DEALER per router. Not the
PUSH/PULL pairs of the local links, because
- it is one port to open and one CURVE handshake (one ZAP check) per router;
- both directions use the connection the router made: the replica needs no address of
  the router (firewalls, NAT) and can answer every frame where it came from;
- the ROUTER socket knows which router sent a request, so outputs go back to that router
  only and several routers can share a replica; a bound PUSH would deal frames out
  round-robin between them, and queue stale stats for a router that is not there.

Link protocol (common/messages.py): a router pings every 0.5 s and gets a ReplicaStatus
(the model identity, state, the scheduler's ready report) for each ping and on every change
of state; requests and outputs are the router <-> scheduler messages. A router not heard
from for ROUTER_TIMEOUT is forgotten and its requests aborted. A bad frame is answered
(ReqError when it names a request, else ReplicaFrameError) and never stops the replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import zmq
import zmq.asyncio

from common import curve
from common.addresses import tcp_address
from common.ipc import Endpoints
from common.messages import (
    REPLICA_CONTROL,
    REPLICA_INBOX,
    AbortReq,
    CacheEvicted,
    DiskReport,
    EmbedOut,
    EmbedReq,
    GenerateReq,
    ModelIdentity,
    ReplicaFrameError,
    ReplicaPing,
    ReplicaStatus,
    ReqError,
    SchedulerReady,
    SchedulerStats,
    TokenOutBatch,
    WorkerHung,
)
from common.protocol import ProtocolError, decode, encode, peek_rid
from common.server_args import ServerArgs
from router.replicas.replica_set import Replica, ReplicaLink, read_scheduler

logger = logging.getLogger("replica")
ROUTER_TIMEOUT = 10.0  # seconds without a frame (pings come every 0.5 s) before a router is gone


class ReplicaServer:
    """The routers' side (the ROUTER socket) and the local pair's (`self.local`, a
    `router.replicas.replica_set.Replica` on ipc), and to
    `router.serving.supervisor.Supervisor` the manager of that one replica: it calls
    replica_down, replica_starting, serving and stopped."""

    def __init__(self, args: ServerArgs, endpoints: Endpoints, identity: ModelIdentity):
        self.args, self.identity = args, identity
        self.instance = uuid.uuid4().hex[:12]
        self.ctx = zmq.asyncio.Context()
        self.auth = None
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        if args.curve_secret_key:
            curve.make_server(self.front, args.curve_secret_key)
            # the ZAP handler must live in the sockets' context; it runs its own thread
            self.auth = curve.start_authenticator(
                zmq.Context.shadow(self.ctx.underlying), args.curve_authorized_keys
            )
        self.front.bind(args.listen)
        link = ReplicaLink.local(self.ctx, endpoints)
        self.local = Replica("r0", endpoints.scheduler_in, link)
        self.replicas = [self.local]  # what a Supervisor asks its manager for
        self.routers: dict[bytes, tuple[str, float]] = {}  # peer -> (its name, last heard)
        self.owner: dict[str, bytes] = {}  # rid -> the router that sent it
        self.state, self.reason = "serving", ""  # "stopped" once it stops

    # ------------------------------------------------------------ routers -> scheduler

    async def front_loop(self) -> None:
        while True:
            parts = await self.front.recv_multipart()
            peer, frames = parts[0], parts[1:]
            name = self.routers.get(peer, ("a router", 0.0))[0]
            self.routers[peer] = (name, time.monotonic())
            if len(frames) != 1:
                self._reply(peer, ReplicaFrameError(f"expected 1 frame, got {len(frames)}"))
                continue
            try:
                msg = decode(frames[0], REPLICA_INBOX)
            except ProtocolError as exc:
                logger.warning("bad frame from %s: %s", name, exc)
                rid = peek_rid(frames[0])
                error = ReqError(rid, f"bad request frame: {exc}") if rid else None
                self._reply(peer, error or ReplicaFrameError(f"bad frame: {exc}"))
                continue
            self._on_router_message(peer, msg, frames[0])

    def _on_router_message(self, peer: bytes, msg, frame: bytes) -> None:
        if isinstance(msg, ReplicaPing):
            if self.routers[peer][0] != msg.router:
                logger.info("router %s connected", msg.router)
                self.routers[peer] = (msg.router, time.monotonic())
            self._reply(peer, self.status())
        elif isinstance(msg, (GenerateReq, EmbedReq)):
            error = self._refusal(msg.rid)
            if error is not None:
                self._reply(peer, error)
                return
            self.owner[msg.rid] = peer
            self._to_scheduler(frame)
        elif isinstance(msg, AbortReq) and self.owner.get(msg.rid) == peer:
            del self.owner[msg.rid]
            self._to_scheduler(frame)

    def _refusal(self, rid: str) -> ReqError | None:
        status = self.status()
        if status.state != "ready":
            why = status.reason or status.state
            return ReqError(rid, f"replica {self.args.listen} is {why}", "service_unavailable", 503)
        if rid in self.owner:
            return ReqError(rid, f"request id {rid!r} is already in use", "duplicate_request_id")
        return None

    # ------------------------------------------------------------ scheduler -> routers

    async def scheduler_loop(self) -> None:
        def lost(rid: str, why: str) -> None:
            self._fail(rid, why, "internal_error", 500)

        await read_scheduler(self.local, self._on_scheduler_message, lost, logger)

    def _on_scheduler_message(self, msg, frame: bytes) -> None:
        if isinstance(msg, TokenOutBatch):
            self._route_outputs(msg, frame)
        elif isinstance(msg, (ReqError, EmbedOut)):  # a request's last word
            peer = self.owner.pop(msg.rid, None)
            if peer is not None:
                self._send(peer, frame)
        elif isinstance(msg, (SchedulerStats, CacheEvicted, DiskReport)):  # every router's
            for peer in self.routers:
                self._send(peer, frame)
        elif isinstance(msg, SchedulerReady):
            self.local.ready, self.local.state, self.local.reason = msg, "ready", ""
            self.local.ready_event.set()
            self._broadcast_status()
        elif isinstance(msg, WorkerHung):
            self.local.hung = msg

    def _route_outputs(self, batch: TokenOutBatch, frame: bytes) -> None:
        """Each output to the router that sent its request (the whole frame when that is
        one router, the common case); outputs nobody waits for are aborted."""
        by_peer: dict[bytes, list] = {}
        for out in batch.outputs:
            peer = self.owner.get(out.rid)
            if peer is None:
                if out.finish_reason is None:
                    self._to_scheduler(encode(AbortReq(out.rid)))
                continue
            by_peer.setdefault(peer, []).append(out)
            if out.finish_reason is not None:
                del self.owner[out.rid]
        for peer, outputs in by_peer.items():
            whole = len(by_peer) == 1 and len(outputs) == len(batch.outputs)
            self._send(peer, frame if whole else encode(TokenOutBatch(outputs)))

    # ------------------------------------------------------------ supervision state

    def status(self) -> ReplicaStatus:
        local = self.local
        if self.state != "serving":
            state, reason = self.state, self.reason
        elif local.state == "ready":
            state, reason = "ready", ""
        elif local.state == "down":
            state, reason = "restarting", f"restarting: {local.reason}"
        else:
            state, reason = "starting", local.reason
        ready = local.ready if state == "ready" else None
        return ReplicaStatus(self.identity, self.instance, state, reason, ready)

    def _broadcast_status(self) -> None:
        for peer in self.routers:
            self._reply(peer, self.status())

    def replica_down(self, replica, reason: str) -> None:
        """Its children died or hung (the Supervisor restarts them)."""
        replica.state, replica.reason, replica.hung = "down", reason, None
        replica.ready = None
        self._broadcast_status()  # first: routers may retry what produced nothing yet
        self.fail_all(reason)

    def replica_starting(self, replica) -> None:
        replica.state, replica.ready_event = "starting", asyncio.Event()
        replica.hung, replica.last_heard = None, time.monotonic()
        self._broadcast_status()

    def serving(self) -> None:
        self._broadcast_status()

    def draining(self) -> None:
        """SIGTERM: routers send nothing new (and new requests are refused with a 503);
        what runs goes on until it ends or the drain times out."""
        self.state, self.reason = "draining", "draining: the replica is shutting down"
        self._broadcast_status()

    def stopped(self, reason: str) -> None:
        self.state, self.reason = "stopped", reason
        self._broadcast_status()
        self.fail_all(reason)

    def fail_all(self, reason: str) -> None:
        for rid in list(self.owner):
            self._fail(rid, reason, "service_unavailable", 503)

    def _fail(self, rid: str, reason: str, code: str, status: int) -> None:
        peer = self.owner.pop(rid, None)
        if peer is not None:
            self._reply(peer, ReqError(rid, f"replica {self.args.listen}: {reason}", code, status))

    async def forget_silent_routers(self) -> None:
        """A router that stopped pinging is gone: abort its requests (nobody reads them)."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for peer, (name, heard) in list(self.routers.items()):
                if now - heard > ROUTER_TIMEOUT:
                    del self.routers[peer]
                    rids = [rid for rid, p in self.owner.items() if p == peer]
                    logger.info("router %s silent for %.0f s; aborting its %d request(s)",
                                name, now - heard, len(rids))  # fmt: skip
                    for rid in rids:
                        del self.owner[rid]
                        self._to_scheduler(encode(AbortReq(rid)))

    # ------------------------------------------------------------ sockets

    def _reply(self, peer: bytes, msg) -> None:
        """A message of the replica's own: a ReplicaStatus or ReplicaFrameError (as a
        control frame), or a ReqError (as the scheduler would send it)."""
        frames = [encode(msg)] if isinstance(msg, ReqError) else [REPLICA_CONTROL, encode(msg)]
        _nowait(self.front.send_multipart([peer, *frames], zmq.NOBLOCK))

    def _send(self, peer: bytes, frame: bytes) -> None:
        """A scheduler frame. Never waits: a router gone or not reading loses it."""
        _nowait(self.front.send_multipart([peer, frame], zmq.NOBLOCK))

    def _to_scheduler(self, frame: bytes) -> None:
        self.local.link.send_nowait(frame)

    def close(self) -> None:
        if self.auth is not None:
            self.auth.stop()
        self.ctx.destroy(linger=0)


def _nowait(sent: asyncio.Future) -> None:
    if sent.done() and sent.exception() is not None:  # retrieved: zmq.Again, dropped
        logger.debug("dropped a frame: %s", sent.exception())


def replica_args_problem(args: ServerArgs) -> str | None:
    """The one line a replica exits 2 with, for flags that cannot work together."""
    if len(args.model_paths) != 1:
        return "a replica serves one model: give --model-path once"
    try:
        tcp_address(args.listen, "--listen")
    except ValueError as exc:
        return str(exc)
    keyed = bool(args.curve_secret_key), bool(args.curve_authorized_keys)
    if keyed[0] != keyed[1]:
        return "--curve-secret-key and --curve-authorized-keys go together"
    if not keyed[0] and not curve.is_loopback(args.listen):
        return (
            f"refusing to listen on {args.listen} without CURVE keys: a non-loopback address "
            "needs --curve-secret-key and --curve-authorized-keys (see `radix-mlx keys`)"
        )
    return None
