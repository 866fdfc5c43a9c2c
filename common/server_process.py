"""A server started as a subprocess and stopped for sure: for tests and benchmarks."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import httpx


class ServerProcess:
    """Runs `cmd`, waits until it is `ready()` (`url`/health answers 200), and always
    stops it."""

    def __init__(self, cmd: list[str], url: str, log_path: Path, env: dict | None = None):
        self.cmd, self.url, self.env = cmd, url, env
        self.new_session = False  # its own process group, to signal the group as systemd does
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120) -> None:
        """Spawn and wait for /health; raises with the log if it dies or never gets healthy."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=self.new_session,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            if self.ready():
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.log()}")

    def ready(self) -> bool:
        """Whether it serves: /health answers 200 (a subclass may ask otherwise)."""
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def log(self, tail: int | None = None) -> str:
        text = self.log_path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-tail:]) if tail else text

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        """Signal, wait, kill if needed; returns the exit status."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
