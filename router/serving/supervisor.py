"""The router's supervision of its children: each local replica's worker and scheduler.

They are spawned (not forked: MLX and ZMQ state must not be copied) and polled every
CHECK_INTERVAL. When one dies (any exit status, a signal, the OOM killer) or the
scheduler's watchdog reports a hung worker step, the requests in flight fail with a 503
naming the process and its exit status, both children are replaced (the KV pool died with
the worker, so the trie must start empty too) by standbys spawned ahead (router.serving.standby)
and serving resumes once the new scheduler reports ready. Each replica (`--dp-size`) is
supervised on its own: a failure takes only that replica down
(`RouterManager.replica_down`) while the others serve. More than --max-restarts restarts
of one replica within RESTART_WINDOW is a crash loop: the supervisor gives that replica
up, and once every local replica is given up the server exits 1, unless it also has
remote replicas (`--replica`): then it serves from them, and /health shows the local ones
`down` with the give-up line.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from collections import deque

from common.child_process import STOP_SIGNAL, StopFlag
from common.distributed_plan import GROUP_BROKEN
from common.ipc import Endpoints
from common.log import run_logged
from common.server_args import ServerArgs
from router.serving.standby import Standbys
from router.serving.stop_signals import start_quietly
from router.serving.worker_group import launched_spec, local_group

logger = logging.getLogger("router")
CHECK_INTERVAL = 0.1  # seconds between liveness checks: a death is noticed well within 1 s
RESTART_WINDOW = 600.0  # seconds over which --max-restarts counts
STARTUP_TIMEOUT = 900.0  # seconds for the worker to load the model and size its pool
STOP_TIMEOUT = 5.0  # seconds children get to exit on STOP_SIGNAL before they are killed
# The scheduler sends stats at least every second, also while it waits for a step; this
# long without a frame from it, it counts as hung.
SCHEDULER_SILENCE = 10.0
# Seconds with no request in flight before the standbys are spawned (`spawn_standbys`).
STANDBY_IDLE = 2.0
ROLES = ("worker", "scheduler")


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
    """One replica's worker and scheduler processes, started again as often as needed.
    `suffix` (`-r1`) names them apart in titles (`radix-mlx::worker-r1`) when there are
    several replicas; `stopping` is shared by all of them. Without `standbys` a restart
    spawns its children afresh (a model loaded on demand: its standbys would cost memory
    and a loaded machine's cores for a restart that seldom comes)."""

    def __init__(self, args: ServerArgs, endpoints: Endpoints, suffix: str = "", stopping=None,
                 standbys: bool = True):  # fmt: skip
        self.args, self.endpoints, self.suffix = args, endpoints, suffix
        self.with_standbys = standbys
        self.mp = multiprocessing.get_context("spawn")
        # set when the router starts to stop (see setup_child)
        self.stopping = stopping if stopping is not None else StopFlag(self.mp)
        self.procs: dict[str, multiprocessing.process.BaseProcess] = {}
        self.standbys = Standbys(self.mp, self._process)
        self.group_dir: str | None = None  # a distributed worker's hostfile and sockets

    def start(self) -> None:
        """Release the standbys (a restart) or spawn the children (the first start). A
        distributed worker's ranks are spawned afresh every time, all of them (a group
        joins once: no standby ranks), before the scheduler."""
        self.procs = {}
        ranks = self._group() if self.args.group_size > 1 else []
        for spec in ranks:
            self.procs[spec.name] = proc = self._process("worker", spec=spec)
            start_quietly(proc)
        for name in self._standby_roles():
            proc = self.standbys.take(name)
            if proc is None:
                proc = self._process(name)
                start_quietly(proc)
            self.procs[name] = proc

    def _standby_roles(self) -> tuple[str, ...]:
        return ROLES if self.args.group_size == 1 else ("scheduler",)

    def _group(self) -> list:
        """The specs of the ranks this machine runs: all of them (a loopback ring), or
        rank 0 alone under mlx.launch (--dist-hostfile; the others run elsewhere)."""
        if self.args.dist_hostfile:
            return [launched_spec(self.args, 0)]
        if self.group_dir is None:
            self.group_dir = tempfile.mkdtemp(prefix="radix-mlx-group-")
        return local_group(self.args, self.group_dir, self.args.transport)

    def spawn_standbys(self) -> None:
        """Spawn what the next restart releases (router.serving.standby), at a quiet moment
        (`Supervisor.watch`): their imports take a core for 1-2 s."""
        if self.with_standbys:
            self.standbys.spawn(self._standby_roles())

    def _process(self, name: str, release=None, spec=None) -> multiprocessing.process.BaseProcess:
        from scheduler.process import run_scheduler
        from worker_mlx.worker import run_worker

        target = {"worker": run_worker, "scheduler": run_scheduler}[name]
        extra = (spec,) if spec is not None else ()
        return self.mp.Process(
            target=run_logged,
            args=(target, self.args, self.endpoints, self.stopping, release, *extra),
            name=(spec.name if spec is not None else name) + self.suffix,
        )

    def pid(self, name: str) -> int | None:
        proc = self.procs.get(name)
        return proc.pid if proc is not None else None

    def dead(self) -> tuple[str, str] | None:
        """(name, what happened) of a child that exited; of a worker group, the rank that
        did not exit only because another one broke the group (GROUP_BROKEN)."""
        gone = [(name, proc.exitcode) for name, proc in self.procs.items() if not proc.is_alive()]
        if not gone:
            return None
        name, code = min(gone, key=lambda g: g[1] == GROUP_BROKEN)
        return name, describe_exit(name, code)

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
        self.standbys.stop(STOP_SIGNAL, STOP_TIMEOUT)
        if self.group_dir is not None:
            shutil.rmtree(self.group_dir, ignore_errors=True)


class Supervisor:
    """Keeps one replica's children serving."""

    def __init__(self, children: Children, replica, manager, metrics, max_restarts: int):
        self.children, self.replica, self.manager = children, replica, manager
        self.metrics, self.max_restarts = metrics, max_restarts
        self.restarts: deque[float] = deque()
        self.name = f"replica {replica.id}: " if len(manager.replicas) > 1 else ""
        self.busy_at = 0.0  # when the replica last had a request in flight, or became ready

    async def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> tuple[str, str] | None:
        """None once the scheduler reported ready, else (process, why not)."""
        started = time.monotonic()
        deadline = started + timeout
        while time.monotonic() < deadline:
            try:
                await asyncio.wait_for(self.replica.ready_event.wait(), CHECK_INTERVAL)
                logger.info("%sworker and scheduler ready %.2f s after their start",
                            self.name, time.monotonic() - started)  # fmt: skip
                self.busy_at = time.monotonic()  # the standbys' quiet moment starts now
                return None
            except asyncio.TimeoutError:
                dead = self.children.dead()
                if dead:
                    return dead
        return "worker", f"start-up timed out after {timeout:.0f} s"

    async def watch(self) -> str:
        """Keep the children serving; returns the line to exit with when it gives up
        ("" when a failure came during a drain, which ends the server anyway)."""
        while True:
            await asyncio.sleep(CHECK_INTERVAL)
            failure = self._failure()
            if failure is None:
                self._spawn_standbys_when_idle()
                continue
            if self.manager.state in ("draining", "stopped"):
                self.manager.replica_down(self.replica, failure[1])  # its requests fail
                return ""
            line = await self._restart(*failure)
            if line:
                return line

    def _spawn_standbys_when_idle(self) -> None:
        """The standbys once the replica had nothing in flight for STANDBY_IDLE: spawned as
        soon as it was ready, their imports took a core from the first requests (on 2
        cores, a benchmark started then gave 0.89x the output tok/s)."""
        now = time.monotonic()
        if self.replica.in_flight or self.replica.state != "ready":
            self.busy_at = now
        elif now - self.busy_at >= STANDBY_IDLE:
            self.children.spawn_standbys()

    def _failure(self) -> tuple[str, str] | None:
        hung = self.replica.hung
        if hung is not None:
            self.children.kill("worker")
            return "worker", (
                f"worker step {hung.step} did not complete within "
                f"{self.children.args.watchdog_timeout:g} s (--watchdog-timeout); killed it"
            )
        silence = time.monotonic() - self.replica.last_heard
        if self.replica.state == "ready" and silence > SCHEDULER_SILENCE:
            self.children.kill("scheduler")
            return "scheduler", f"scheduler sent nothing for {silence:.0f} s; killed it"
        return self.children.dead()

    async def _restart(self, process: str, reason: str) -> str:
        """Replace both children until they report ready; a crash loop returns the line
        to give up with."""
        while True:
            self.metrics.observe_death(process, self.replica.id)
            self.manager.replica_down(self.replica, reason)
            now = time.monotonic()
            while self.restarts and now - self.restarts[0] > RESTART_WINDOW:
                self.restarts.popleft()
            if len(self.restarts) >= self.max_restarts:
                return (
                    f"giving up: {self.name}{reason}, and {len(self.restarts)} restarts within "
                    f"{RESTART_WINDOW:.0f} s reached --max-restarts {self.max_restarts}"
                )
            if self.children.args.dist_hostfile:
                return (
                    f"giving up: {reason}; a worker group on several machines "
                    "(--dist-hostfile) is not restarted from here: run the mlx.launch "
                    "command again"
                )
            self.restarts.append(now)
            logger.error("%s%s; restarting the worker and the scheduler", self.name, reason)
            self.children.kill_all()
            self.manager.replica_starting(self.replica)
            self.children.start()
            failure = await self.wait_ready()
            if failure is None:
                self.manager.serving()
                logger.info("%sserving again, %.1f s after the failure", self.name,
                            time.monotonic() - now)  # fmt: skip
                return ""
            process, reason = failure


class Supervision:
    """Every replica's supervisor: the server goes on while one replica is not given up."""

    def __init__(self, supervisors: list[Supervisor]):
        self.supervisors = supervisors

    async def _all_given_up(self, manager, line: str) -> str:
        """Every local replica is given up: the server stops, unless it also serves from
        remote replicas (they come and go on their own, so it goes on while it has any)."""
        ours = {sup.replica for sup in self.supervisors}
        if any(r not in ours for r in manager.replicas):
            logger.error("%s; every local replica is given up, the remote ones go on", line)
            await asyncio.Event().wait()
        manager.stopped(line)
        return line

    async def wait_ready(self) -> tuple[str, str] | None:
        for sup in self.supervisors:
            failure = await sup.wait_ready()
            if failure is not None:
                return failure
        return None

    async def watch(self) -> str:
        """The give-up line once every replica is given up ("" after a failure during a
        drain)."""
        if not self.supervisors:  # remote replicas only: nothing of ours to give up
            await asyncio.Event().wait()
        tasks = {asyncio.create_task(s.watch()): s for s in self.supervisors}
        line = ""
        try:
            while tasks:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    sup = tasks.pop(task)
                    line = task.result()
                    if not line:
                        return ""
                    sup.replica.reason = line
                    if tasks:
                        logger.error("%s; the other replicas go on", line)
            return await self._all_given_up(sup.manager, line)
        finally:
            for task in tasks:
                task.cancel()
