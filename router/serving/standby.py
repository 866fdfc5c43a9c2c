"""Standby children: a worker and a scheduler spawned ahead of need, imports done.

A fresh worker spends most of its start in Python imports (mlx-lm pulls in transformers:
about 1 s on an idle core, 5 s on a loaded one) while loading a small model takes 0.02 s.
So once the children are ready and the replica has had nothing in flight for a moment
(`Supervisor.watch`: spawned at once, their imports slowed the first requests), the
supervisor spawns one standby per role; a standby does its imports and then waits to be
released. A restart releases the standbys instead of spawning, which leaves the model
load and the start-up self-check. A standby costs an idle process (about 80 MiB for the
worker, 20 MiB for the scheduler) and exits with its parent or on STOP_SIGNAL, as the
children do.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from router.serving.stop_signals import start_quietly


@dataclass
class Standby:
    proc: object  # multiprocessing.Process
    release: object  # multiprocessing.Event: set to make it run


class Standbys:
    """At most one standby per role, taken by `take` and replaced by `spawn`."""

    def __init__(self, mp, make_process):
        """`make_process(name, release)`: an unstarted Process running that role."""
        self.mp, self.make_process = mp, make_process
        self.ready: dict[str, Standby] = {}
        # Released ones, until replaced: their Event must outlive the child's unpickling
        # of it (a spawn context unlinks an Event's semaphore when it is collected).
        self.released: dict[str, Standby] = {}

    def spawn(self, names) -> None:
        for name in names:
            if name not in self.ready:
                release = self.mp.Event()
                proc = self.make_process(name, release)
                start_quietly(proc)  # spawned while serving; setup_child unblocks
                self.ready[name] = Standby(proc, release)

    def take(self, name: str):
        """The role's standby process, released; None when there is none alive."""
        standby = self.ready.pop(name, None)
        if standby is None:
            return None
        if not standby.proc.is_alive():
            standby.proc.join(0)
            return None
        standby.release.set()
        self.released[name] = standby
        return standby.proc

    def stop(self, sig: int, timeout: float) -> None:
        """Signal every standby, wait up to `timeout`, kill what is left."""
        for standby in self.ready.values():
            if standby.proc.is_alive():
                os.kill(standby.proc.pid, sig)
        for standby in self.ready.values():
            standby.proc.join(timeout)
            if standby.proc.is_alive():
                os.kill(standby.proc.pid, signal.SIGKILL)
                standby.proc.join(timeout)
        self.ready.clear()
