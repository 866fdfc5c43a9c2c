"""A real `radix-mlx serve` process on free loopback ports, for end-to-end tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from common.ipc import free_ports
from common.server_process import ServerProcess as _Process

RADIX_MLX = str(Path(sys.executable).parent / "radix-mlx")


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
