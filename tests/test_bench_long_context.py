"""benchmarks.long_context --prompt-lens runs end to end on the tiny model, and the
admission's prediction bounds what mlx measured in every row (a bound, not a byte count:
those differ between machines). In its own process, as it is run: the benchmark loads a
worker's runner, whose CPU kernels stay installed for the life of the process."""

from __future__ import annotations

import json
import subprocess
import sys


def test_admission_mode_measures_under_the_prediction(tiny_model, tmp_path):
    out = tmp_path / "r.jsonl"
    cmd = [
        sys.executable, "-m", "benchmarks.long_context", "--model-path", tiny_model,
        "--prompt-lens", "300", "1500", "--batch-size", "2", "--output-len", "3",
        "--max-memory", "2GiB", "--result-file", str(out),
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| prompt tokens | predicted step | MLX peak |" in run.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt_tokens"] for r in rows] == [300, 1500]
    for r in rows:
        assert not r["refused"] and r["steps"] >= 3
        assert 0 < r["mlx"] <= r["predicted"]
    assert rows[1]["predicted"] > rows[0]["predicted"]
    assert [r["mode"] for r in rows] == ["admission"] * 2
