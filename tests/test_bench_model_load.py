"""benchmarks.model_load with two rounds: each first request to the unloaded model is
answered, and its TTFT and the server's load time are in the record. The figures
themselves are a benchmark's."""

from __future__ import annotations

import json

import pytest

from benchmarks.model_load import main

pytestmark = pytest.mark.slow


def test_two_rounds_are_timed(tiny_model, tiny_llama, tmp_path):
    argv = ["--rounds", "2", "--model-path", tiny_model, "--other-model-path", tiny_llama,
            "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    (path,) = tmp_path.glob("model-load-*.json")
    record = json.loads(path.read_text())
    first, second = record["rounds"]
    assert first["model"] != second["model"]  # each round loads the other model
    for row in record["rounds"]:
        assert 0 < row["load_s"] < row["ttft_s"]
    assert "median TTFT - load" in record["report"]
