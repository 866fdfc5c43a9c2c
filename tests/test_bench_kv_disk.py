"""benchmarks.kv_disk_restart on the tiny model with a short session: the restarted
server's first request comes from disk and the record says so. The figures themselves
are a benchmark's."""

from __future__ import annotations

import json

import pytest

from benchmarks.kv_disk_restart import main

pytestmark = pytest.mark.slow


def test_restart_ttft_is_recorded(tiny_model, tmp_path):
    argv = ["--model-path", tiny_model, "--prompt-len", "512", "--block", "64",
            "--server-args", "--max-total-tokens 2048", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    (path,) = tmp_path.glob("kv_disk_restart-*.json")
    record = json.loads(path.read_text())
    assert record["cached_tokens"] >= 512
    assert record["restart_ttft_s"] > 0 and record["cold_ttft_s"] > 0
    assert "ratio" in record["report"]
