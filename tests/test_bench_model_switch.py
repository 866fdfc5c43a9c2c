"""benchmarks.model_switch with one short round: every request of both orders is timed
and the report has both models' ratios. The figures themselves are a benchmark's."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks.model_switch import main

pytestmark = pytest.mark.slow


def test_one_round_times_both_orders(tiny_model, tiny_llama, tmp_path):
    argv = ["--rounds", "1", "--requests", "2", "--max-tokens", "3", "--prompt-len", "8",
            "--model-path", tiny_model, "--other-model-path", tiny_llama,
            "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    (path,) = tmp_path.glob("model-switch-*.json")
    record = json.loads(path.read_text())
    models = [os.path.basename(tiny_model), os.path.basename(tiny_llama)]
    alternating = [r["model"] for r in record["rows"] if r["order"] == "alternating"]
    assert alternating == models * 2
    assert all(r["ttft_s"] > 0 and r["tpot_s"] > 0 for r in record["rows"])
    assert all(name in record["report"] for name in models)
