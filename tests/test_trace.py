"""`--trace-dir`: every process's events, and the first-token report built from them."""

from __future__ import annotations

import httpx
import pytest

from benchmarks.trace_report import STAGES, first_token_timelines, read_events, report, step_times
from common.trace import Trace
from tests.conftest import mlx_greedy
from tests.server import ServerProcess


def test_trace_without_a_directory_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trace = Trace(None, "router")
    trace("submit", "r1")
    assert not trace.enabled
    assert list(tmp_path.iterdir()) == []


def test_report_follows_each_first_token_through_the_processes(tmp_path):
    """Hand-written traces: a request prefilled in step 1, then one decode step."""
    (tmp_path / "router.1.trace").write_text("100 submit a\n900 tokens a\n1200 tokens a\n")
    (tmp_path / "scheduler.2.trace").write_text(
        "150 request a\n200 extend 1 a\n700 result 1\n750 out a\n1000 decode 2 a\n1150 out a\n"
    )
    (tmp_path / "worker.3.trace").write_text(
        "300 recv 1\n600 done 1\n1020 recv 2 ahead\n1100 done 2\n"
    )
    (timeline,) = first_token_timelines(read_events(str(tmp_path))).values()
    stages = [timeline[b] - timeline[a] for _, a, b in STAGES]
    assert stages == [50, 50, 100, 300, 100, 50, 150]  # they add up to the TTFT, 800 ns
    steps = step_times(read_events(str(tmp_path)))
    assert steps == {"extend": [300e-6], "decode computed ahead": [80e-6]}
    assert report(str(tmp_path)).startswith("1 requests with a complete first-token timeline")


@pytest.mark.slow
def test_served_requests_leave_complete_timelines(tiny_model, tmp_path):
    trace_dir = tmp_path / "trace"
    extra = ["--max-total-tokens", "2048", "--trace-dir", str(trace_dir)]
    server = ServerProcess(tiny_model, tmp_path / "log", extra=extra)
    server.start()
    prompt = list(range(3, 40))
    try:
        for _ in range(3):  # cold, then the same prompt twice
            body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            assert r.json()["choices"][0]["token_ids"] == mlx_greedy(tiny_model, prompt, 4)
    finally:
        assert server.stop() == 0
    assert {p.name.split(".")[0] for p in trace_dir.iterdir()} == {"router", "scheduler", "worker"}
    events = read_events(str(trace_dir))
    timelines = first_token_timelines(events)
    assert len(timelines) >= 3  # the router's own warm-up requests may add more
    for marks in timelines.values():
        assert all(marks[b] >= marks[a] for _, a, b in STAGES), marks
    steps = step_times(events)
    decodes = steps.get("decode", []) + steps.get("decode computed ahead", [])
    assert len(steps["extend"]) >= 3 and len(decodes) >= 9
    assert "TTFT (router side)" in report(str(trace_dir))
