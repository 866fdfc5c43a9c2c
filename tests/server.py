"""Start and stop a real `radix-mlx serve` process for end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from common.ipc import free_ports

RADIX_MLX = str(Path(sys.executable).parent / "radix-mlx")


class ServerProcess:
    def __init__(self, model: str, log_path: Path, extra: list[str] | None = None):
        self.port, self.zmq_port = free_ports(2)
        self.model = model
        self.log_path = Path(log_path)
        self.cmd = [
            RADIX_MLX, "serve", "--model-path", model, "--port", str(self.port),
            "--zmq-port", str(self.zmq_port), *(extra or []),
        ]  # fmt: skip
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def zmq_address(self) -> str:
        return f"tcp://127.0.0.1:{self.zmq_port}"

    def start(self, timeout: float = 120) -> None:
        self._log = open(self.log_path, "wb")
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> list[int]:
        """PIDs of this server's child processes (worker, scheduler, helpers)."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
