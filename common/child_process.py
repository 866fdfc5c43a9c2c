"""What each radix-mlx process sets up first: a title `ps` shows, and how it stops.

The router stops its children with STOP_SIGNAL. SIGINT (a terminal's Ctrl-C reaches the
whole process group) is the router's to handle. A SIGTERM may be an operator's `kill` of
this one process, which should stop it (the router then restarts it), or one sent to the
whole group by systemd or a container runtime, which the router answers by draining:
its children must keep serving until it stops them. So after a SIGTERM a child waits up
to GROUP_SIGNAL_GRACE for the router to say it is stopping (at once, if it got the same
signal), and exits if it does not.

A standby child (`router.standby`) is titled `radix-mlx::<name>-standby` until it is
released, and exits meanwhile if its parent dies.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys

from setproctitle import setproctitle

TITLE_PREFIX = "radix-mlx::"
STOP_SIGNAL = signal.SIGUSR1
GROUP_SIGNAL_GRACE = 2.0  # seconds for the router to mark itself stopping (a loaded machine)
PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_CHECK = 1.0  # seconds between a standby's checks that its parent still lives


def set_title(name: str) -> None:
    setproctitle(TITLE_PREFIX + name)


def setup_child(name: str, router_stopping=None, release=None) -> None:
    """`router_stopping`: a multiprocessing Event the router sets when it starts to stop;
    `release`: for a standby, the Event that `wait_for_release` waits on. The title is
    the process's name when the router gave it one that extends `name` (`worker-r1`: a
    replica's worker), with `-standby` until a standby is released."""
    set_title(_title(name) if release is None else f"{_title(name)}-standby")
    if release is not None:
        die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(STOP_SIGNAL, lambda *_: sys.exit(0))

    def on_sigterm(*_) -> None:
        if router_stopping is None or not router_stopping.wait(GROUP_SIGNAL_GRACE):
            sys.exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    # a standby is spawned with these blocked (router.standby); its handlers are in place
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})


def die_with_parent() -> None:
    """A standby holds nothing: on Linux the kernel kills it with its parent, also while
    it imports (its own check of the parent runs only once the imports are done)."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux
        pass


def _title(name: str) -> str:
    given = multiprocessing.current_process().name
    return given if given.startswith(name) else name


def wait_for_release(name: str, release=None) -> None:
    """A standby returns here once released (the supervisor needs it), titled as a child."""
    if release is None:
        return
    parent = os.getppid()
    while not release.wait(PARENT_CHECK):
        if os.getppid() != parent:
            sys.exit(0)
    set_title(_title(name))
