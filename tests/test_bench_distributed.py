"""The distributed benchmarks run end to end on two loopback ranks and their figures add up."""

from __future__ import annotations

import subprocess
import sys

from benchmarks import one_batch


def test_one_batch_on_two_ranks_against_one_process(tiny_model, tmp_path):
    out = tmp_path / "r.jsonl"
    baseline, group = one_batch.main(
        ["--model-path", tiny_model, "--tp-size", "2", "--batch-size", "1", "2"]
        + ["--input-len", "8", "--output-len", "5", "--result-file", str(out)]
    )
    assert [r["batch_size"] for r in baseline] == [r["batch_size"] for r in group] == [1, 2]
    for base, row in zip(baseline, group):
        assert "tp_size" not in base and row["tp_size"] == 2 and row["pp_size"] == 1
        assert row["run"] != base["run"]
        assert row["collective_seconds"] > 0
        assert row["collective_share"] == row["collective_seconds"] / row["median_decode_latency"]
        ratio = row["median_decode_latency"] / base["median_decode_latency"]
        assert row["decode_latency_vs_one_process"] == ratio
    assert len(out.read_text().splitlines()) == 4  # rank 0's rows only, and the baseline's


def test_fanout_compares_zeromq_with_a_broadcast():
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.fanout", "--frames", "20"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ZeroMQ round trip (ipc):" in out.stdout
    assert "broadcast / ZeroMQ:" in out.stdout
