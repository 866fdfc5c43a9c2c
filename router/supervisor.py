"""The router's supervision of its children: the worker and the scheduler.

They are spawned (not forked: MLX and ZMQ state must not be copied) and polled every
CHECK_INTERVAL. When one dies (any exit status, a signal, the OOM killer) or the
scheduler's watchdog reports a hung worker step, the requests in flight fail with a 503
naming the process and its exit status, both children are replaced (the KV pool died with
the worker, so the trie must start empty too) and serving resumes once the new scheduler
reports ready. More than --max-restarts restarts within RESTART_WINDOW is a crash loop:
the supervisor gives up and the server exits 1.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import time
from collections import deque

from common.child_process import STOP_SIGNAL
from common.ipc import Endpoints
from common.server_args import ServerArgs

logger = logging.getLogger("router")
CHECK_INTERVAL = 0.1  # seconds between liveness checks: a death is noticed well within 1 s
RESTART_WINDOW = 600.0  # seconds over which --max-restarts counts
STARTUP_TIMEOUT = 900.0  # seconds for the worker to load the model and size its pool
STOP_TIMEOUT = 5.0  # seconds children get to exit on STOP_SIGNAL before they are killed
# The scheduler sends stats at least every second, also while it waits for a step; this
# long without a frame from it, it counts as hung.
SCHEDULER_SILENCE = 10.0


def describe_exit(name: str, code: int | None) -> str:
    """`worker process exited with status -9 (SIGKILL)`."""
    text = f"{name} process exited with status {code}"
    if code is not None and code < 0:
        try:
            text += f" ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return text


class Children:
    """The worker and scheduler processes, started again as often as needed."""

    def __init__(self, args: ServerArgs, endpoints: Endpoints):
        self.args, self.endpoints = args, endpoints
        self.mp = multiprocessing.get_context("spawn")
        self.stopping = self.mp.Event()  # set when the router starts to stop (see setup_child)
        self.procs: dict[str, multiprocessing.process.BaseProcess] = {}

    def start(self) -> None:
        from scheduler.process import run_scheduler
        from worker_mlx.worker import run_worker

        targets = {"worker": run_worker, "scheduler": run_scheduler}
        self.procs = {
            name: self.mp.Process(
                target=target, args=(self.args, self.endpoints, self.stopping), name=name
            )
            for name, target in targets.items()
        }
        for proc in self.procs.values():
            proc.start()

    def pid(self, name: str) -> int | None:
        proc = self.procs.get(name)
        return proc.pid if proc is not None else None

    def dead(self) -> tuple[str, str] | None:
        """(name, what happened) of a child that exited."""
        for name, proc in self.procs.items():
            if not proc.is_alive():
                return name, describe_exit(name, proc.exitcode)
        return None

    def kill(self, name: str) -> None:
        """SIGKILL: works on a stopped (SIGSTOP'd) or hung process too."""
        proc = self.procs.get(name)
        if proc is not None and proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(STOP_TIMEOUT)

    def kill_all(self) -> None:
        for name in self.procs:
            self.kill(name)

    def stop(self) -> None:
        """Ask each child to exit; kill what is left after STOP_TIMEOUT."""
        for proc in self.procs.values():
            if proc.is_alive():
                os.kill(proc.pid, STOP_SIGNAL)
        deadline = time.monotonic() + STOP_TIMEOUT
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill_all()


class Supervisor:
    def __init__(self, children: Children, manager, metrics, max_restarts: int):
        self.children, self.manager, self.metrics = children, manager, metrics
        self.max_restarts = max_restarts
        self.restarts: deque[float] = deque()

    async def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> tuple[str, str] | None:
        """None once the scheduler reported ready, else (process, why not)."""
        started = time.monotonic()
        deadline = started + timeout
        while time.monotonic() < deadline:
            try:
                await asyncio.wait_for(self.manager.ready_event.wait(), CHECK_INTERVAL)
                logger.info("worker and scheduler ready %.2f s after their start",
                            time.monotonic() - started)  # fmt: skip
                return None
            except asyncio.TimeoutError:
                dead = self.children.dead()
                if dead:
                    return dead
        return "worker", f"start-up timed out after {timeout:.0f} s"

    async def watch(self) -> str:
        """Keep the children serving; returns the line to exit with when it gives up."""
        while True:
            await asyncio.sleep(CHECK_INTERVAL)
            failure = self._failure()
            if failure is None:
                continue
            if self.manager.state in ("draining", "stopped"):
                self.manager.fail_all(failure[1])  # the drain ends the server
                return ""
            line = await self._restart(*failure)
            if line:
                return line

    def _failure(self) -> tuple[str, str] | None:
        hung = self.manager.hung
        if hung is not None:
            self.children.kill("worker")
            return "worker", (
                f"worker step {hung.step} did not complete within "
                f"{self.children.args.watchdog_timeout:g} s (--watchdog-timeout); killed it"
            )
        silence = time.monotonic() - self.manager.last_heard
        if self.manager.state == "serving" and silence > SCHEDULER_SILENCE:
            self.children.kill("scheduler")
            return "scheduler", f"scheduler sent nothing for {silence:.0f} s; killed it"
        return self.children.dead()

    async def _restart(self, process: str, reason: str) -> str:
        """Replace both children until they report ready; a crash loop returns the line
        to exit with."""
        while True:
            self.metrics.observe_death(process)
            self.manager.restarting(reason)
            now = time.monotonic()
            while self.restarts and now - self.restarts[0] > RESTART_WINDOW:
                self.restarts.popleft()
            if len(self.restarts) >= self.max_restarts:
                self.manager.stopped(reason)
                return (
                    f"giving up: {reason}, and {len(self.restarts)} restarts within "
                    f"{RESTART_WINDOW:.0f} s reached --max-restarts {self.max_restarts}"
                )
            self.restarts.append(now)
            logger.error("%s; restarting the worker and the scheduler", reason)
            self.children.kill_all()
            self.children.start()
            failure = await self.wait_ready()
            if failure is None:
                self.manager.serving()
                logger.info("serving again, %.1f s after the failure", time.monotonic() - now)
                return ""
            process, reason = failure
