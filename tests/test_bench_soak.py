"""benchmarks.soak for a few seconds with one worker kill: the tool runs, the server
restarts, nothing hangs, only 503s are lost, and the pool is empty when idle. The real
run (10 minutes, two kills) is a benchmark: see the README."""

from __future__ import annotations

import json

import pytest

from benchmarks.soak import main

pytestmark = pytest.mark.slow


def test_short_soak_with_a_worker_kill(tiny_model, tmp_path):
    argv = ["--minutes", "0.25", "--kill-worker-at", "5", "--concurrency", "3",
            "--model-path", tiny_model, "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    (path,) = tmp_path.glob("soak-*.json")
    record = json.loads(path.read_text())
    results = {result: n for _, result, n in record["results"]}
    assert results.get("ok", 0) > 0 and results.get("rejected", 0) > 0
    failed = {r for r in results if r not in ("ok", "dropped", "rejected")}
    assert failed <= {"503 service_unavailable", "stream error: service_unavailable"}, failed
    (kill,) = record["kills"]
    assert kill["to_503"] is not None and kill["to_200"] > kill["to_503"]
    assert len(record["children_start_s"]) == 2  # the cold start and the restart
    assert record["idle"]["num_running_requests"] == 0
    assert record["idle"]["used_slots"] == 0
    assert "| 1 |" in record["report"]
