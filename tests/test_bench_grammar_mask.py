"""benchmarks.grammar_mask on the tiny model with few steps: every figure it reports is a
positive, finite time or ratio, and it records the line it prints."""

from __future__ import annotations

import json
import math

from benchmarks import grammar_mask


def test_grammar_mask_reports_sane_figures(tiny_model, tmp_path, capsys):
    out = tmp_path / "g.jsonl"
    row = grammar_mask.main(["--model-path", tiny_model, "--steps", "6", "--out", str(out)])
    printed = capsys.readouterr().out
    keys = [
        "llguidance_mask_ms",
        "unconstrained_ms",
        "constrained_ms",
        "constrained_vs_unconstrained",
    ]
    for key in keys:
        assert isinstance(row[key], float) and math.isfinite(row[key]) and row[key] > 0, key
        assert key in printed
    assert json.loads(out.read_text().splitlines()[-1]) == row
