"""Repeated and overlapping stop signals never hang a real server: SIGTERM twice, SIGINT
then SIGTERM, a burst of both, to the router alone or to its whole process group (what
systemd and container runtimes send). The router's handlers only note the signal; the
event loop acts on it (a handler that took a lock could be re-entered by the next signal
and wait on itself forever). Each case: the router and its children exit within the
bounds, with status 0 and no traceback."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.server import ReplicaProcess, ServerProcess, exited

pytestmark = pytest.mark.slow

TERM, INT = signal.SIGTERM, signal.SIGINT
# (signals, seconds between them, to the whole group)
BURST = [TERM, INT] * 50  # on main, one burst in about 4 hung the router
CASES = {
    "term-term": ([TERM, TERM], 0.0, False),
    "group-int-term": ([INT, TERM], 0.05, True),
    **{f"group-burst-{i}": (BURST, 0.0, True) for i in range(2)},
}
EXIT_WITHIN = 15  # seconds: nothing to drain, then the children's STOP_TIMEOUT at most


def _storm(pid: int, sigs, gap: float, group: bool) -> None:
    for sig in sigs:
        (os.killpg if group else os.kill)(pid, sig)
        if gap:
            time.sleep(gap)


def _check_stops(server, sigs, gap: float, group: bool) -> None:
    children = server.children()
    started = time.monotonic()
    _storm(server.proc.pid, sigs, gap, group)
    try:
        code = server.proc.wait(EXIT_WITHIN)
    except Exception as exc:
        raise AssertionError(f"no exit within {EXIT_WITHIN} s:\n{server.log(40)}") from exc
    assert code == 0, server.log(40)
    assert exited(children, 10), server.log(40)
    assert time.monotonic() - started < EXIT_WITHIN
    assert "Traceback" not in server.log(), server.log()


def _kill_group(server) -> None:
    """Whatever a failed case left behind."""
    try:
        os.killpg(server.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.proc.wait()


@pytest.mark.parametrize("sigs, gap, group", CASES.values(), ids=CASES.keys())
def test_serve_stops_on_any_signal_storm(tiny_model, tmp_path, sigs, gap, group):
    server = ServerProcess(tiny_model, tmp_path / "log", extra=["--max-total-tokens", "4096"])
    server.new_session = True  # its own group, so a group signal reaches nothing else
    server.start()
    try:
        _check_stops(server, sigs, gap, group)
    finally:
        _kill_group(server)


def test_serve_stops_on_a_signal_while_starting(tiny_model, tmp_path):
    """Before it serves (the model loads) there is nothing to drain: it stops at once."""
    server = ServerProcess(tiny_model, tmp_path / "log", extra=["--max-total-tokens", "4096"])
    server.new_session = True
    server.ready = lambda: "runtime directory" in server.log()
    server.start()
    try:
        _check_stops(server, BURST, 0.0, True)
    finally:
        _kill_group(server)


def test_replica_stops_on_a_signal_storm(tiny_model, tmp_path):
    replica = ReplicaProcess(tiny_model, tmp_path / "log", extra=["--max-total-tokens", "4096"])
    replica.new_session = True
    replica.start()
    try:
        _check_stops(replica, BURST, 0.0, True)
    finally:
        _kill_group(replica)
