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

import mlx.core as mx
import zmq

from worker_mlx.distributed_plan import GroupSpec, hostfile_hosts

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
