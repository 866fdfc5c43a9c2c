"""ZMQ endpoints and socket helpers shared by the three processes."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import zmq

from common.child_process import parent_alive, parent_pid


@dataclass(frozen=True)
class Endpoints:
    """Where each one-way PUSH/PULL link lives; the receiving side binds."""

    scheduler_in: str  # router -> scheduler
    router_in: str  # scheduler -> router
    worker_in: str  # scheduler -> worker
    scheduler_from_worker: str  # worker -> scheduler
    # scheduler -> the worker's disk tier (a copy of each LoadBatch, for its reader
    # thread to start at once; "": none)
    worker_loads: str = ""

    @classmethod
    def ipc(cls, runtime_dir: str) -> Endpoints:
        def path(name: str) -> str:
            return f"ipc://{os.path.join(runtime_dir, name)}"

        return cls(
            path("scheduler.sock"),
            path("router.sock"),
            path("worker.sock"),
            path("scheduler-worker.sock"),
            path("worker-loads.sock"),
        )

    @classmethod
    def tcp(cls, host: str = "127.0.0.1") -> Endpoints:
        ports = free_ports(5, host)
        return cls(*(f"tcp://{host}:{p}" for p in ports))


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """Ports the OS says are free right now (bound together so they are distinct)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def bind_pull(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    return sock


def connect_push(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


class ParentWatch:
    """Lets a child notice that its parent died, so it exits instead of lingering."""

    def __init__(self):
        self.parent = parent_pid()  # the parent at spawn: it may have died since

    def parent_alive(self) -> bool:
        return parent_alive(self.parent)
