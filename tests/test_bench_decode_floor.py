"""benchmarks.bandwidth and benchmarks.decode_floor on the tiny model: the floor is the
bytes a decode step must read over the measured bandwidth, and grows with context."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bandwidth, decode_floor
from worker_mlx.backends import cpu_split


def test_copy_bandwidth_is_measured_both_ways(tmp_path):
    out = tmp_path / "bw.jsonl"
    row = bandwidth.main(["--mib", "32", "--repeats", "2", "--result-file", str(out)])
    assert row["numpy_copy_gbps"] > 0.1 and row["mlx_copy_gbps"] > 0.1
    assert row["gbps"] == max(row["numpy_copy_gbps"], row["mlx_copy_gbps"])
    assert json.loads(out.read_text())["gbps"] == row["gbps"]


def test_decode_step_against_its_floor(tiny_model, tmp_path, capsys):
    out = tmp_path / "floor.jsonl"
    rows = decode_floor.main(
        ["--model-path", tiny_model, "--context", "40", "120", "--batch-size", "3"]
        + ["--input-len", "8", "--output-len", "5", "--rounds", "1", "--bandwidth-mib", "16"]
        + ["--result-file", str(out), "--one-batch-file", str(tmp_path / "ob.jsonl")]
    )
    weights = sum(f.stat().st_size for f in Path(tiny_model).glob("*.safetensors"))
    assert [r["context"] for r in rows] == [42.5, 122.5]  # mid-decode: + output_len / 2
    per_token = rows[0]["kv_bytes_read"] / (3 * 42.5)
    for r in rows:
        assert r["weight_bytes"] == weights > 0
        assert r["kv_bytes_read"] == pytest.approx(3 * r["context"] * per_token)
        floor = (weights + r["kv_bytes_read"]) / (r["bandwidth_gbps"] * 1e9)
        assert r["floor_s"] == pytest.approx(floor)
        assert r["step_vs_floor"] == pytest.approx(r["decode_step_s"] / floor)
    assert rows[1]["floor_s"] > rows[0]["floor_s"]
    assert "step÷floor" in capsys.readouterr().out
    assert len(out.read_text().splitlines()) == 2


def test_decode_split_times_weights_and_attention(capsys):
    from benchmarks import decode_split

    decode_split.main(["--preset", "tiny", "--batch-size", "2", "--context", "40", "300"]
                      + ["--repeats", "1"])  # fmt: skip
    out = capsys.readouterr().out
    assert out.count("weights, ") == 2
    assert "attention at     40 tokens" in out and "attention at    300 tokens" in out
    # each context whole and, with two threads, in halves; the backend's way marked once
    halves = out.count("in halves: best") + out.count("in halves (the backend's): best")
    assert halves == (2 if cpu_split.threads() >= 2 else 0)
    assert out.count("(the backend's)") == 2
    assert cpu_split.second_stream(1 << 62) is None  # the benchmark took its stream back
