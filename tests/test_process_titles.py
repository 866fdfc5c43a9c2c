"""`ps` tells the servers of one machine apart: every process of a server is titled with
its role first, then the server's port and model (`radix-mlx::router :30000 Qwen3-0.6B`),
the multiprocessing resource tracker included. Real servers, titles read from /proc."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path

import pytest

from tests.server import ReplicaProcess, ServerProcess, title_role

SERVED = "example-org/Tiny-Served"  # --served-model-name: titles show its last part


def _title(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0].decode()


def _titles(root: int) -> dict[str, str]:
    """{role: full title} of `root` and its children."""
    pids = [root, *(int(p) for p in os.popen(f"pgrep -P {root}").read().split())]
    out = {}
    for pid in pids:
        with contextlib.suppress(FileNotFoundError):  # exited meanwhile
            out[title_role(Path(f"/proc/{pid}/cmdline").read_bytes())] = _title(pid)
    return out


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("titles") / "server.log"
    srv = ServerProcess(tiny_model, log, ["--max-total-tokens", "1024",
                                          "--served-model-name", SERVED])  # fmt: skip
    srv.start()
    yield srv
    srv.stop()


def test_every_process_is_titled_role_port_model(server):
    tail = f":{server.port} Tiny-Served"
    roles = ("router", "worker", "scheduler", "worker-standby", "scheduler-standby",
             "resource-tracker")  # fmt: skip
    want = {f"radix-mlx::{role}": f"radix-mlx::{role} {tail}" for role in roles}
    # the standbys are spawned once serving, and each titles itself after its imports
    deadline = time.monotonic() + 60
    while True:
        titles = _titles(server.proc.pid)
        if {role: titles.get(role) for role in want} == want:
            break
        assert time.monotonic() < deadline, titles
        time.sleep(0.1)
    assert all(role.startswith("radix-mlx::") for role in titles), titles


def test_a_replica_is_titled_with_its_listen_port(tiny_model, tmp_path):
    with socket.socket() as spare:
        spare.bind(("127.0.0.1", 0))
        port = spare.getsockname()[1]
    replica = ReplicaProcess(tiny_model, tmp_path / "replica.log", port=port)
    replica.start()
    try:
        titles = _titles(replica.proc.pid)
        tail = f":{port} {Path(tiny_model).name}"
        for role in ("replica", "worker", "scheduler", "resource-tracker"):
            assert titles.get(f"radix-mlx::{role}") == f"radix-mlx::{role} {tail}", titles
    finally:
        replica.stop()
