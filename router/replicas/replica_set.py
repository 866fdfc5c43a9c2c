"""Replicas: the scheduler+worker pairs one router serves a model from.

A `Replica` is what the router knows of one pair: its id (`r0`, `r1`, ...), the address
its scheduler is reached at, its state, its link and its load. The `RouterManager` sends a
request to the scheduler of the replica its routing policy picks and reads every replica's
outputs, each on its own receive task; a replica's supervisor (local pairs:
`router.serving.supervisor`) reports its failures (`RouterManager.replica_down`).

States: `starting` (spawned or reconnecting; no traffic), `ready` (its SchedulerReady came;
it gets traffic), `draining` (a remote replica shutting down: no new traffic, its requests
in flight go on), `down` (dead, silent, or given up; its in-flight requests were failed or
retried), `refused` (it serves another model; never gets traffic).

The seam for a replica this router did not start (a pair reached at tcp://HOST:PORT): it
needs a `ReplicaLink` (below) whose `send` reaches its scheduler with the messages of
`common.messages.SCHEDULER_FROM_ROUTER` and whose `recv` returns the scheduler's frames
(`ROUTER_INBOX`: TokenOutBatch, ReqError, SchedulerReady, SchedulerStats, CacheEvicted,
WorkerHung); `RouterManager.add_replica` then starts reading it. Its ready report is the
SchedulerReady frame (the manager marks it ready); its liveness is the stream of
SchedulerStats (at least one a second): one silent for SILENT_AFTER gets no new traffic,
and whatever watches it calls `replica_down` when it gives it up. Nothing else of the
router differs between a local and a remote replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from common.ipc import Endpoints, bind_pull, connect_push
from common.messages import ROUTER_INBOX, SchedulerReady, SchedulerStats, WorkerHung
from common.protocol import ProtocolError, decode, peek_rids

# A replica whose scheduler has sent nothing for this long gets no new requests until it
# speaks again (its scheduler sends stats at least once a second, also during a long step).
SILENT_AFTER = 2.0
STATES = ("starting", "ready", "draining", "down", "refused")


class ReplicaLink:
    """Frames to and from one replica's scheduler: a PUSH to its inbox, a PULL it pushes
    to (the receiving side binds, as on every link). A remote link may differ."""

    def __init__(self, ctx: zmq.asyncio.Context, to_scheduler: str, from_scheduler: str):
        self.push = connect_push(ctx, to_scheduler)
        self.pull = bind_pull(ctx, from_scheduler)

    @classmethod
    def local(cls, ctx: zmq.asyncio.Context, endpoints: Endpoints) -> ReplicaLink:
        return cls(ctx, endpoints.scheduler_in, endpoints.router_in)

    async def send(self, frame: bytes) -> None:
        await self.push.send(frame)

    def send_nowait(self, frame: bytes) -> bool:
        """False when the frame was dropped (no scheduler connected, queue full)."""
        sent = self.push.send(frame, zmq.NOBLOCK)  # a Future, done at once
        return not (sent.done() and sent.exception() is not None)

    async def recv(self) -> bytes:
        return await self.pull.recv()

    def close(self) -> None:
        self.push.close(linger=0)
        self.pull.close(linger=0)


@dataclass(eq=False)
class Replica:
    id: str
    address: str
    link: ReplicaLink
    state: str = "starting"
    reason: str = ""  # why it is down or refused
    ready: SchedulerReady | None = None  # its last ready report
    ready_event: asyncio.Event = field(default_factory=asyncio.Event)
    stats: SchedulerStats | None = None
    hung: WorkerHung | None = None  # its scheduler's watchdog fired
    last_heard: float = field(default_factory=time.monotonic)
    in_flight: set[str] = field(default_factory=set)  # rids routed here, not yet ended
    routed: int = 0  # requests sent here (retries included)

    @property
    def load(self) -> int:
        return len(self.in_flight)

    def serves(self, now: float) -> bool:
        """Takes new requests: ready and heard from within SILENT_AFTER."""
        return self.state == "ready" and now - self.last_heard <= SILENT_AFTER

    def describe(self) -> dict:
        return {"id": self.id, "address": self.address, "state": self.state}


class ReplicaSet:
    """The replicas in id order."""

    def __init__(self, replicas: list[Replica] | None = None):
        self.replicas: list[Replica] = list(replicas or [])

    def __iter__(self):
        return iter(self.replicas)

    def __len__(self) -> int:
        return len(self.replicas)

    def add(self, replica: Replica) -> None:
        if any(r.id == replica.id for r in self.replicas):
            raise ValueError(f"replica id {replica.id!r} is already in use")
        self.replicas.append(replica)

    def get(self, replica_id: str) -> Replica | None:
        return next((r for r in self.replicas if r.id == replica_id), None)

    def serving(self) -> list[Replica]:
        """The ready replicas heard from lately; if none was, every ready one (a loaded
        machine delays them all alike, and there is nowhere better to send a request)."""
        now = time.monotonic()
        ready = [r for r in self.replicas if r.state == "ready"]
        return [r for r in ready if r.serves(now)] or ready

    def first_ready(self) -> SchedulerReady | None:
        """A ready report (every replica serves the same model, so any will do)."""
        return next((r.ready for r in self.replicas if r.ready is not None), None)


async def read_scheduler(
    replica: Replica,
    on_message: Callable[[object, bytes], None],
    on_lost: Callable[[str, str], None],
    log: logging.Logger,
) -> None:
    """Read a replica's scheduler frames for ever (the router's and a remote replica's
    relay alike): each is a sign of life; a decoded one goes to `on_message(msg, frame)`;
    one that does not decode is logged, and each request it names is lost
    (`on_lost(rid, why)`: its answer is gone, so it must not wait)."""
    while True:
        frame = await replica.link.recv()
        replica.last_heard = time.monotonic()
        try:
            msg = decode(frame, ROUTER_INBOX)
        except ProtocolError as exc:
            log.error("bad frame from the scheduler of replica %s: %s", replica.id, exc)
            for rid in peek_rids(frame):
                on_lost(rid, f"bad frame from the scheduler: {exc}")
            continue
        on_message(msg, frame)
