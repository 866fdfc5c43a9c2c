"""The real scheduler process never waits on an answer that cannot come: a WorkerError of
no step or an undecodable reply while a step is in flight fails that step's requests,
and a step slower than --watchdog-timeout is reported to the router (WorkerHung)."""

from __future__ import annotations

import random
import time

from common.messages import ExtendBatch, WorkerError, WorkerHung
from common.protocol import encode
from tests.scripted_worker import SchedulerHarness, toks


def _reply_first_extend_with(h: SchedulerHarness, frame: bytes) -> None:
    """Before the worker answers its first extend, the scheduler gets `frame`."""

    def hook(msg) -> bool:
        if isinstance(msg, ExtendBatch):
            h.to_scheduler.send(frame)
            time.sleep(0.05)  # it lands before the real answer
            return True
        return False

    h.on_worker(hook)


def _fails_then_serves(h: SchedulerHarness, needle: str) -> None:
    rng = random.Random(0)
    h.submit("a", toks(rng, 20), 8)
    h.run_until(lambda: h.done("a"), 10, "the failed step's request to end")
    error = h.results["a"].error
    assert error is not None and needle in error.message, h.results["a"]
    assert error.status == 500
    h.submit("b", toks(rng, 20), 8)
    h.run_until(lambda: h.done("b"), 10, "the next request")
    assert h.results["b"].error is None
    assert h.results["b"].tokens == h.model.expected("b")[0]
    h.wait_idle()  # the failed request's slots are back: nothing runs, nothing is held
    assert not h.worker.violations, h.worker.violations


def test_worker_error_of_no_step_fails_the_step_in_flight(make_harness):  # noqa: F811
    h = make_harness(256)
    _reply_first_extend_with(h, encode(WorkerError(step=-1, message="bad frame: truncated")))
    _fails_then_serves(h, "bad frame: truncated")


def test_undecodable_reply_fails_the_step_in_flight(make_harness):  # noqa: F811
    h = make_harness(256)
    _reply_first_extend_with(h, b"\xc1 not msgpack")
    _fails_then_serves(h, "undecodable reply from the worker")


def test_slow_step_is_reported_to_the_router_once(make_harness):  # noqa: F811
    h = make_harness(256, watchdog_timeout=0.3)
    hung = []
    on_router = h._on_router
    h._on_router = lambda msg: hung.append(msg) if isinstance(msg, WorkerHung) else on_router(msg)

    def slow(msg) -> bool:
        if isinstance(msg, ExtendBatch):
            time.sleep(2.5)  # past the watchdog, through two of the scheduler's 1 s polls
            return True
        return False

    h.on_worker(slow)
    h.submit("a", toks(random.Random(1), 10), 4)
    h.wait_done()
    assert [m.step for m in hung] == [1], hung
    assert hung[0].seconds > 0.3
    h.verify()  # a late answer is still used: the router decides what a hang costs
