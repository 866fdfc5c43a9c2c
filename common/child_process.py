"""What each radix-mlx process sets up first: a title `ps` shows, and how it stops.

The router stops its children with STOP_SIGNAL. SIGINT (a terminal's Ctrl-C reaches the
whole process group) is the router's to handle. A SIGTERM may be an operator's `kill` of
this one process, which should stop it (the router then restarts it), or one sent to the
whole group by systemd or a container runtime, which the router answers by draining:
its children must keep serving until it stops them. So after a SIGTERM a child gives the
router GROUP_SIGNAL_GRACE to say it is stopping (a `StopFlag`), and exits if it did not.
The handlers only read the flag and set a timer: they take no lock, so no signal, and no
other process dying at any moment, can leave them waiting.

A standby child (`router.serving.standby`) is titled `radix-mlx::<name>-standby` until it is
released, and exits meanwhile if its parent dies.

Titles name the role first, then the server: its port and its model's short name
(`radix-mlx::router :30000 Qwen3-0.6B`, `radix-mlx::worker-1 :30000 Qwen3-0.6B`), so `ps`
tells the servers of one machine apart. The router or replica sets the server part once;
its children are spawned with its environment, so they inherit it (TITLE_ENV).
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


class StopFlag:
    """Set by the router when it starts to stop, read by its children's signal handlers.
    A byte of shared memory rather than a multiprocessing Event, whose lock a handler
    could wait on forever (held by the code the signal interrupted, or by a process
    killed while holding it). Pass it to a child when it is spawned."""

    def __init__(self, mp):
        self._byte = mp.RawValue("b", 0)

    def set(self) -> None:
        self._byte.value = 1

    def is_set(self) -> bool:
        return bool(self._byte.value)


TITLE_ENV = "RADIX_MLX_TITLE"  # the server part of every title, ":PORT MODEL"
TRACKER_MAIN = "from multiprocessing.resource_tracker import main"  # its `python -c` code


def server_title(port: int | str, model: str) -> str:
    """`:30000 Qwen3-0.6B`: a server's port and its model's short name (a Hugging Face
    id's or a directory's last part)."""
    return f":{port} {model.rstrip('/').rsplit('/', 1)[-1]}"


def set_title(name: str, server: str | None = None) -> None:
    """Title this process `radix-mlx::<name> <server part>`; `server` (server_title) is
    given once, by the router or replica, for its children to inherit."""
    if server is not None:
        os.environ[TITLE_ENV] = server
    tail = os.environ.get(TITLE_ENV)
    setproctitle(TITLE_PREFIX + name + (f" {tail}" if tail else ""))


def start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker titled `radix-mlx::resource-tracker`. The
    first spawned child would start it anyway, as `python -c '<TRACKER_MAIN>(fd)'`, which
    `ps` shows as nobody's; started here, its code sets its title first (the tracker
    takes no arguments of ours, so its command is the one place to put it)."""
    from multiprocessing import resource_tracker, util

    title = TITLE_PREFIX + "resource-tracker"
    if os.environ.get(TITLE_ENV):
        title += " " + os.environ[TITLE_ENV]
    code = f"from setproctitle import setproctitle; setproctitle({title!r}); "
    spawnv = util.spawnv_passfds

    def titled(path, args, passfds):
        args = [code + a if str(a).startswith(TRACKER_MAIN) else a for a in args]
        return spawnv(path, args, passfds)

    util.spawnv_passfds = titled
    try:
        resource_tracker.ensure_running()
    finally:
        util.spawnv_passfds = spawnv


def setup_child(name: str, router_stopping: StopFlag | None = None, release=None) -> None:
    """`router_stopping`: the StopFlag the router sets when it starts to stop;
    `release`: for a standby, the Event that `wait_for_release` waits on. The title is
    the process's name when the router gave it one that extends `name` (`worker-r1`: a
    replica's worker), with `-standby` until a standby is released."""
    set_title(_title(name) if release is None else f"{_title(name)}-standby")
    if release is not None:
        die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(STOP_SIGNAL, lambda *_: sys.exit(0))

    def on_sigterm(*_) -> None:
        if router_stopping is None:
            sys.exit(0)
        if not router_stopping.is_set():  # decide when the grace is over
            signal.setitimer(signal.ITIMER_REAL, GROUP_SIGNAL_GRACE)

    def on_grace_over(*_) -> None:
        if not router_stopping.is_set():  # an operator's kill of this process alone
            sys.exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGALRM, on_grace_over)
    # a standby is spawned with these blocked (router.serving.standby); its handlers are in place
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})


def parent_pid() -> int:
    """The pid of the process that started this one. For a multiprocessing child that
    is the pid its parent passed at spawn, not `os.getppid()` now: a parent that died
    while the child imported has already left it to init, and a check against the
    reaper's pid would never see the death."""
    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None else os.getppid()


def parent_alive(pid: int) -> bool:
    return os.getppid() == pid


def die_with_parent() -> None:
    """On Linux the kernel kills this process with its parent: a standby (it holds
    nothing) also while it imports, before its own check of the parent runs; a worker
    rank also while it waits in a collective. A parent that died before the prctl sends
    no signal, hence the check after it."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux
        pass
    if not parent_alive(parent_pid()):
        os._exit(0)


def _title(name: str) -> str:
    given = multiprocessing.current_process().name
    return given if given.startswith(name) else name


def wait_for_release(name: str, release=None) -> None:
    """A standby returns here once released (the supervisor needs it), titled as a child."""
    if release is None:
        return
    parent = parent_pid()
    while not release.wait(PARENT_CHECK):
        if not parent_alive(parent):
            sys.exit(0)
    set_title(_title(name))
