"""How the router and a replica take SIGTERM and SIGINT: on their event loop, never in a
signal handler.

A Python signal handler runs in the main thread between any two bytecodes, so one that
takes a lock (a multiprocessing Event's, logging's) can be entered again by the next
signal while the first holds the lock, and wait on itself forever: a second SIGTERM, or
a burst to the whole process group, hung the router so. Here the signals are held
(blocked) from the start of the process until its loop is running, then the loop's own
handler (`loop.add_signal_handler`: its C handler writes the number to a wakeup pipe)
runs the callback as an ordinary loop callback. Once the loop is done, the signals are
held again: the clean-up that follows is bounded (the children's STOP_TIMEOUT) and must
not be cut short by a default action.

Blocking holds a signal only for the threads that block it, and a process-directed
signal goes to any thread that does not: one that existed before the hold (OpenBLAS's
pool, started when mlx is imported) takes it, and with the default action there it
killed the process (status -15) while it loaded the model. So while the signals are
held, their handler also only notes them (an append takes no lock), and `on_loop`
delivers what it noted.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
_noted: list[int] = []  # stop signals a thread that did not block them took while held


def _note(signum: int, _frame) -> None:
    _noted.append(signum)


def hold_stop_signals() -> None:
    """Block SIGTERM and SIGINT: they stay pending until `on_loop` takes them. Children
    spawned meanwhile inherit the mask (`common.child_process.setup_child` unblocks)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    for sig in STOP_SIGNALS:
        signal.signal(sig, _note)


def on_loop(loop: asyncio.AbstractEventLoop, callback: Callable[[int], None]) -> None:
    """From now on each stop signal calls `callback(signum)` on `loop`; any that came
    while they were held arrives now."""
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, callback, sig)
    while _noted:
        loop.call_soon(callback, _noted.pop(0))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def start_quietly(proc) -> None:
    """Start a multiprocessing child with the stop signals blocked: one landing between
    its fork and exec would run the loop's C handler in the copy, which writes to the
    loop's wakeup pipe it inherited: a signal the router never got."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
