"""A real `radix-mlx serve` process on free loopback ports, for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from common.ipc import free_ports
from common.server_process import ServerProcess as _Process

RADIX_MLX = str(Path(sys.executable).parent / "radix-mlx")


def exited(pids: list[int], timeout: float = 10) -> bool:
    """Whether every one of `pids` is gone within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive or time.monotonic() > deadline:
            return not alive
        time.sleep(0.05)


def title_role(cmdline: bytes) -> str:
    """`radix-mlx::worker` of a /proc/PID/cmdline titled `radix-mlx::worker :30000 M`."""
    return cmdline.split(b"\0", 1)[0].decode(errors="replace").split(" ", 1)[0]


class ServerProcess(_Process):
    def __init__(self, model: str, log_path: Path, extra: list[str] | None = None):
        self.port, self.zmq_port = free_ports(2)
        self.model = model
        cmd = [
            RADIX_MLX, "serve", "--model-path", model, "--port", str(self.port),
            "--zmq-port", str(self.zmq_port), *(extra or []),
        ]  # fmt: skip
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        super().__init__(cmd, f"http://127.0.0.1:{self.port}", log_path, env)

    @property
    def zmq_address(self) -> str:
        return f"tcp://127.0.0.1:{self.zmq_port}"

    def children(self) -> list[int]:
        """PIDs of this server's child processes (worker, scheduler, helpers)."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def child(self, name: str, timeout: float = 5) -> int:
        """The pid of the child whose process title is radix-mlx::<name> (the role: the
        title goes on with the server's port and model)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for pid in self.children():
                try:
                    cmd = open(f"/proc/{pid}/cmdline", "rb").read()
                except FileNotFoundError:
                    continue  # exited meanwhile
                if title_role(cmd) == f"radix-mlx::{name}":
                    return pid
            time.sleep(0.05)
        raise AssertionError(f"no radix-mlx::{name} child of {self.proc.pid}")


def log_lines(server, pattern: str, timeout: float = 10) -> list[str]:
    """The server log's lines matching `pattern` (written once the response is sent)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [line for line in server.log().splitlines() if re.search(pattern, line)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


@contextlib.contextmanager
def checked_server(model: str, log_path: Path, extra: list[str]):
    """A server a test module shares, which must outlive the tests: it fails the module's
    last test if the server died or logged a traceback meanwhile."""
    srv = ServerProcess(model, log_path, extra=extra)
    srv.start()
    try:
        yield srv
    finally:
        alive = srv.proc.poll() is None
        srv.stop()
    assert alive, "the server died during the tests:\n" + srv.log()[-3000:]
    log = srv.log()
    assert "Traceback" not in log, log[max(0, log.find("Traceback") - 2000) :][:6000]


class ReplicaProcess(ServerProcess):
    """A real `radix-mlx replica` listening on a loopback port (a free one by default)."""

    READY = "waiting for routers"  # its log line once its scheduler and worker are ready

    def __init__(self, model: str, log_path: Path, extra: list[str] | None = None, port=None):
        self.port = port or free_ports(1)[0]
        self.model = model
        self.address = f"tcp://127.0.0.1:{self.port}"
        cmd = [RADIX_MLX, "replica", "--model-path", model, "--listen", self.address,
               *(extra or [])]  # fmt: skip
        _Process.__init__(self, cmd, self.address, log_path, dict(os.environ, HF_HUB_OFFLINE="1"))

    def ready(self) -> bool:
        return self.READY in self.log()
