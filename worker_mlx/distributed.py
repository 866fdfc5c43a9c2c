"""A worker as a group of rank processes joined by mx.distributed.

Rank 0 is the worker the scheduler knows: it receives the descriptors, forwards each
valid frame unchanged to every other rank over ZeroMQ (one PUSH socket per rank, bound by
rank 0) before running it, and alone answers. The other ranks run the same frames in the
same order, so every rank evaluates the same collectives in the same order, lookahead
steps and deferred flushes included (they follow from the frames alone). Forwarding over
ZeroMQ, not over the group, keeps descriptors off the collective stream: a broadcast
would cost a collective per step and need a fixed-size buffer (docs/performance.md has
both measured). Every rank samples the same token: under tensor parallelism the
logits are identical on all ranks after the all_sum of the last layer; under pipeline
parallelism the last stage's hidden states are gathered to every rank, which applies
the norm and the head itself.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time

import mlx.core as mx
import zmq

from common.distributed_plan import GroupSpec, hostfile_hosts
from common.messages import DecodeBatch

logger = logging.getLogger("worker")


def join_group(spec: GroupSpec) -> Rank:
    """mx.distributed's group for this rank: with a hostfile from the router, the env
    mlx.launch would set; under mlx.launch, the env as it is."""
    if spec.hostfile:
        os.environ["MLX_HOSTFILE"] = spec.hostfile
        os.environ["MLX_RANK"] = str(spec.rank)
    group = mx.distributed.init(strict=True, backend=spec.backend)
    if group.size() != spec.size or group.rank() != spec.rank:
        logger.error(
            "mx.distributed (%s) made this rank %d of %d, expected %d of %d",
            spec.backend, group.rank(), group.size(), spec.rank, spec.size,
        )  # fmt: skip
        raise SystemExit(2)
    return Rank(spec, group, _hosts())


def _hosts() -> list[str]:
    path = os.environ.get("MLX_HOSTFILE")
    try:
        with open(path) as f:
            return hostfile_hosts(json.load(f))
    except (OSError, TypeError, ValueError):
        return []


def agree_pool_size(group: mx.distributed.Group, num_slots: int) -> int:
    """The pool size every rank can hold: all ranks index the same slot ids."""
    agreed = mx.distributed.all_min(mx.array([num_slots], dtype=mx.int32), group=group)
    return int(agreed.item())


class Rank:
    """This process's place in the group: its spec, the joined group, each rank's host
    and what of the model it holds (set by distributed_shard)."""

    def __init__(self, spec: GroupSpec, group: mx.distributed.Group, hosts: list[str]):
        self.spec, self.group, self.hosts = spec, group, hosts
        self.share = ""

    def log(self, num_slots: int) -> None:
        spec = self.spec
        host = self.hosts[spec.rank] if spec.rank < len(self.hosts) else socket.gethostname()
        logger.info(
            "rank %d of %d (%s parallel, backend %s) on %s holds %s; KV pool %d tokens "
            "(the smallest rank's)", spec.rank, spec.size, spec.mode, spec.backend, host,
            self.share, num_slots,
        )  # fmt: skip


PROBE_EVERY = 64  # decode steps between two timings of a step's collectives


def replay_collectives(rank: Rank, batch: int, hidden: int, layers: int) -> float:
    """Seconds one decode step's collectives take replayed alone, chained: a step's
    collectives run inside one lazy graph and cannot be timed there. TP: two all_sums of
    (batch, 1, hidden) per layer; PP: the stage-to-stage send / receive and the gather of
    the last stage's hidden states. Every rank must call it at the same point."""
    spec, group = rank.spec, rank.group
    y = mx.ones((batch, 1, hidden))
    mx.eval(y)
    start = time.perf_counter()
    if spec.tp > 1:
        for _ in range(2 * layers):
            y = mx.distributed.all_sum(y, group=group) * (1 / spec.tp)
    else:
        if spec.rank > 0:
            y = mx.distributed.recv_like(y, spec.rank - 1, group=group)
        if spec.rank < spec.pp - 1:
            y = mx.distributed.send(y, spec.rank + 1, group=group)
        y = mx.distributed.all_gather(y, group=group)
    mx.eval(y)
    return time.perf_counter() - start


class CollectiveProbe:
    """Times the collectives of every PROBE_EVERY-th decode step (the first included)
    after it ran; every rank counts the same frames, so all replay at the same point.
    Rank 0 reports the time with its next answer (`StepResult.collective_seconds`)."""

    def __init__(self, rank: Rank, model):
        self.rank, self.decodes, self.pending = rank, 0, 0.0
        args = getattr(model, "args", None)
        self.hidden = getattr(args, "hidden_size", 0)
        self.layers = getattr(args, "num_hidden_layers", 0)

    def after(self, msg) -> None:
        if not isinstance(msg, DecodeBatch) or not self.hidden:
            return
        self.decodes += 1
        if self.decodes % PROBE_EVERY == 1:
            self.pending = replay_collectives(self.rank, len(msg.rids), self.hidden, self.layers)

    def take(self) -> float:
        out, self.pending = self.pending, 0.0
        return out


class Fanout:
    """Rank 0's side: each descriptor frame goes to every other rank before it runs."""

    def __init__(self, ctx: zmq.Context, endpoints: tuple[str, ...]):
        self.socks = []
        for endpoint in endpoints[1:]:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(endpoint)
            self.socks.append(sock)

    def __call__(self, frame: bytes) -> None:
        for sock in self.socks:
            sock.send(frame)


def follower_inbox(ctx: zmq.Context, spec: GroupSpec) -> zmq.Socket:
    """A rank > 0's inbox: what rank 0 forwards."""
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(spec.fanout[spec.rank])
    return sock
