"""benchmarks.restart with one kill: streams in flight get their error, /health goes 503
and back to 200, and the record says so. The figures themselves are a benchmark's."""

from __future__ import annotations

import json

import pytest

from benchmarks.restart import main

pytestmark = pytest.mark.slow


def test_one_kill_is_timed(tiny_model, tmp_path):
    argv = ["--kills", "1", "--settle", "0", "--streams", "2", "--model-path", tiny_model,
            "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    (path,) = tmp_path.glob("restart-*.json")
    record = json.loads(path.read_text())
    (kill,) = record["kills"]
    assert len(kill["in_flight_errors"]) == 2
    assert 0 < kill["to_503"] < kill["to_200"]
    assert record["mlx_lm_load_s"] > 0
    assert "median kill to /health 200" in record["report"]
