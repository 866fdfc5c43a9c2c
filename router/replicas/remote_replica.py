"""The router's link to a remote replica (`radix-mlx replica --listen ADDRESS`).

One DEALER socket connected to the replica's ROUTER socket (router/replicas/replica_server.py says
why), CURVE when the router has keys. To the router's manager it is a replica link like a
local one: `send` / `send_nowait` take the scheduler's messages, `recv` returns the
scheduler's frames, and a SchedulerReady frame when the replica becomes ready. Inside,
it pings every PING_INTERVAL; the replica answers each ping with a ReplicaStatus, and the
link turns what it hears, and what it does not, into the replica's `state`:
- `ready`: it serves the router's model (its ModelIdentity equals the router's) and its
  scheduler is ready;
- `starting`: connected; its children are loading or being restarted;
- `draining`: it is shutting down (SIGTERM): no new requests, those in flight go on;
- `down`: nothing heard for SILENCE_TIMEOUT (dead, unreachable or hung), or it stopped;
- `refused`: it serves another model, or the CURVE handshake failed (a key that does not
  match); the reason says which, logged once as one line.
`on_state(link)` is called after every change. A silent replica comes back by itself:
ZMQ reconnects and the next status makes it ready again (its `instance` tells a restarted
replica apart). After a failed handshake libzmq stops reconnecting, so the link connects
anew every REFUSED_RETRY.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import time
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from common import curve
from common.messages import (
    REPLICA_CONTROL,
    REPLICA_CONTROL_INBOX,
    ModelIdentity,
    ReplicaFrameError,
    ReplicaPing,
    ReplicaStatus,
    SchedulerReady,
)
from common.model_identity import mismatch
from common.protocol import ProtocolError, decode, encode
from common.server_args import ServerArgs

logger = logging.getLogger("router")
PING_INTERVAL = 0.5  # seconds between pings (each answered by a ReplicaStatus)
SILENCE_TIMEOUT = 1.5  # seconds without a frame before the replica counts as down (< 2 s)
CHECK_INTERVAL = 0.1  # seconds between checks for silence: down within 1.6 s
REFUSED_RETRY = 5.0  # seconds between fresh connections after a failed CURVE handshake
HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
)
MONITORED = zmq.EVENT_HANDSHAKE_SUCCEEDED | sum(HANDSHAKE_FAILURES)


class RemoteLink:
    def __init__(
        self,
        address: str,
        identity: ModelIdentity,
        args: ServerArgs,
        ctx: zmq.asyncio.Context,
        on_state: Callable[[RemoteLink], None] = lambda link: None,
    ):
        self.address, self.identity, self.args = address, identity, args
        self.on_state = on_state
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.state, self.reason = "starting", "connecting"
        self.ready: SchedulerReady | None = None
        self.instance: str | None = None
        self.last_heard = time.monotonic()
        self._handshake_failed_at: float | None = None
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a replica not connected
        if args.curve_secret_key:
            curve.make_client(self.sock, args.curve_secret_key, args.curve_server_key)
        self.monitor = self.sock.get_monitor_socket(MONITORED)
        self.sock.connect(address)
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Pinging and watching the handshake (on the running loop), until `close`."""
        self._tasks = [asyncio.create_task(c) for c in (self._ping_loop(), self._monitor_loop())]

    async def send(self, frame: bytes) -> None:
        """Never waits: a replica that cannot take the frame now is down."""
        if not self.send_nowait(frame) and self.state == "ready":
            self._set("down", "the replica's connection is gone")

    def send_nowait(self, frame: bytes) -> bool:
        """False when the frame was dropped (not connected, or its queue is full)."""
        sent = self.sock.send(frame, zmq.NOBLOCK)  # a Future, done at once
        return not (sent.done() and sent.exception() is not None)  # retrieved: zmq.Again

    async def recv(self) -> bytes:
        """The next frame of the scheduler's (decoded by the caller, as a local link's);
        a SchedulerReady frame when the replica became ready."""
        while True:
            parts = await self.sock.recv_multipart()
            self.last_heard = time.monotonic()
            if len(parts) == 1:
                return parts[0]
            if len(parts) != 2 or parts[0] != REPLICA_CONTROL:
                logger.error("dropping a frame of %d parts from replica %s", len(parts),
                             self.address)  # fmt: skip
                continue
            try:
                msg = decode(parts[1], REPLICA_CONTROL_INBOX)
            except ProtocolError as exc:
                logger.error("bad control frame from replica %s: %s", self.address, exc)
                continue
            if isinstance(msg, ReplicaFrameError):
                logger.error("replica %s could not read a frame: %s", self.address, msg.message)
            elif self._on_status(msg):
                return encode(self.ready)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)

    # ------------------------------------------------------------ loops

    async def _ping_loop(self) -> None:
        ping, pinged = encode(ReplicaPing(self.name)), 0.0
        while True:
            now = time.monotonic()
            if now - pinged >= PING_INTERVAL:
                self.send_nowait(ping)
                pinged = now
            failed_at = self._handshake_failed_at
            if failed_at is not None:
                if now - failed_at > REFUSED_RETRY:  # libzmq gave up: a new connection
                    self._handshake_failed_at = now
                    self.sock.disconnect(self.address)
                    self.sock.connect(self.address)
            elif self.state != "down" and self._silent(now):
                self.ready = None
                silence = now - self.last_heard
                self._set("down", f"no answer from the replica for {silence:.1f} s")
            await asyncio.sleep(CHECK_INTERVAL)

    def _silent(self, now: float) -> bool:
        """Nothing heard for SILENCE_TIMEOUT, and nothing waiting to be read (a busy
        router loop is not a silent replica)."""
        # `get`, not `getsockopt`: only the asyncio socket's `get` re-arms its reader after
        # reading EVENTS consumed the fd's edge (else a waiting frame is never received)
        waiting = self.sock.get(zmq.EVENTS) & zmq.POLLIN
        return now - self.last_heard > SILENCE_TIMEOUT and not waiting

    async def _monitor_loop(self) -> None:
        while True:
            event = (await recv_monitor_message(self.monitor))["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshake_failed_at = None
            elif event in HANDSHAKE_FAILURES:
                self.ready, self._handshake_failed_at = None, time.monotonic()
                self._set("refused", self._handshake_failure(event))

    # ------------------------------------------------------------ state

    def _on_status(self, status: ReplicaStatus) -> bool:
        """Take in a status; True when it made the replica ready."""
        if self.instance not in (None, status.instance) and self.state == "ready":
            self._set("down", "the replica restarted")  # what ran on the old one is lost
        self.instance = status.instance
        different = mismatch(self.identity, status.identity)
        was_ready = self.state == "ready"
        if different:
            self.ready = None
            self._set("refused", f"another model: {different}")
        elif status.state == "ready" and status.ready is not None:
            self.ready = status.ready
            self._set("ready", "")
            return not was_ready
        elif status.state in ("starting", "restarting"):
            self.ready = None
            self._set("starting", status.reason or status.state)
        elif status.state == "draining":  # shutting down: its requests in flight go on
            self.ready = None
            self._set("draining", status.reason or status.state)
        else:
            self.ready = None
            self._set("down", status.reason or status.state)
        return False

    def _handshake_failure(self, event: int) -> str:
        if not self.args.curve_secret_key:
            return (
                "the security handshake failed: the replica needs CURVE keys and this router "
                "has none (--curve-secret-key, --curve-server-key)"
            )
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (
                "the replica does not admit this router's CURVE key "
                "(add its public key to the replica's --curve-authorized-keys)"
            )
        return (
            "the CURVE handshake failed: --curve-server-key is not this replica's public key, "
            "or the replica has no keys"
        )

    def _set(self, state: str, reason: str) -> None:
        if (state, reason) == (self.state, self.reason):
            return
        if state == "refused":
            logger.error("refusing replica %s: %s", self.address, reason)
        elif state == "down":
            logger.warning("replica %s is down: %s", self.address, reason)
        else:
            logger.info("replica %s is %s%s", self.address, state, f": {reason}" if reason else "")
        self.state, self.reason = state, reason
        self.on_state(self)


def attach_remote_replicas(manager, args: ServerArgs, identity: ModelIdentity, ctx) -> None:
    """Each `--replica` address as one of the manager's replicas (ids after the local
    ones), its link's state changes passed on as the manager's replica_down and
    replica_starting (the SchedulerReady frame from `recv` makes it ready)."""
    from router.replicas.replica_set import Replica

    for i, address in enumerate(args.replica or [], len(manager.replicas)):
        replica = Replica(f"r{i}", address, link=None)
        replica.link = RemoteLink(address, identity, args, ctx,
                                  functools.partial(_follow, manager, replica))  # fmt: skip
        manager.add_replica(replica)
        replica.link.start()


def _follow(manager, replica, link: RemoteLink) -> None:
    if link.state == "draining":  # no new requests; it answers those it has
        replica.state, replica.reason = "draining", link.reason
        return
    if link.state == "ready":
        if replica.state == "refused":
            replica.state = "starting"  # takes the SchedulerReady that `recv` returns next
        return
    if replica.state == "ready" or link.state != "starting":
        manager.replica_down(replica, link.reason)  # its requests fail, or are retried
    if link.state == "starting":
        manager.replica_starting(replica)
    else:
        replica.state = link.state  # down, or refused
    replica.reason = link.reason
