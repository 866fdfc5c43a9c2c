"""What each radix-mlx process sets up first: a title `ps` shows, and how it stops.

The router stops its children with STOP_SIGNAL. SIGINT (a terminal's Ctrl-C reaches the
whole process group) is the router's to handle. A SIGTERM may be an operator's `kill` of
this one process, which should stop it (the router then restarts it), or one sent to the
whole group by systemd or a container runtime, which the router answers by draining:
its children must keep serving until it stops them. So after a SIGTERM a child waits up
to GROUP_SIGNAL_GRACE for the router to say it is stopping (at once, if it got the same
signal), and exits if it does not.
"""

from __future__ import annotations

import multiprocessing
import signal
import sys

from setproctitle import setproctitle

TITLE_PREFIX = "radix-mlx::"
STOP_SIGNAL = signal.SIGUSR1
GROUP_SIGNAL_GRACE = 2.0  # seconds for the router to mark itself stopping (a loaded machine)


def set_title(name: str) -> None:
    setproctitle(TITLE_PREFIX + name)


def setup_child(name: str, router_stopping=None) -> None:
    """`router_stopping`: a multiprocessing Event the router sets when it starts to stop.
    The title is the process's name when the router gave it one that extends `name`
    (`worker-r1`: a replica's worker)."""
    given = multiprocessing.current_process().name
    set_title(given if given.startswith(name) else name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(STOP_SIGNAL, lambda *_: sys.exit(0))

    def on_sigterm(*_) -> None:
        if router_stopping is None or not router_stopping.wait(GROUP_SIGNAL_GRACE):
            sys.exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
