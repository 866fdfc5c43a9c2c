"""benchmarks.long_context --prompt-lens runs end to end on the tiny model, and the
admission's prediction bounds what mlx measured in every row (a bound, not a byte count:
those differ between machines)."""

from __future__ import annotations

import json

from benchmarks import long_context


def test_admission_mode_measures_under_the_prediction(tiny_model, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    rows = long_context.main(
        ["--model-path", tiny_model, "--prompt-lens", "300", "1500", "--batch-size", "2"]
        + ["--output-len", "3", "--max-memory", "2GiB", "--result-file", str(out)]
    )
    printed = capsys.readouterr().out
    assert "| prompt tokens | predicted step | MLX peak |" in printed
    assert [r["prompt_tokens"] for r in rows] == [300, 1500]
    for r in rows:
        assert not r["refused"] and r["steps"] >= 3
        assert 0 < r["mlx"] <= r["predicted"]
    assert rows[1]["predicted"] > rows[0]["predicted"]
    assert [json.loads(line)["mode"] for line in out.read_text().splitlines()] == ["admission"] * 2
