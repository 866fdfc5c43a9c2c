"""benchmarks.hop runs a real child process and threads with tiny counts; its figures are
sane (positive, finite, p90 >= p50) and it prints and records one line per mode."""

from __future__ import annotations

import json
import math
import os

import pytest

from benchmarks import hop
from common.messages import WORKER_INBOX
from common.protocol import decode, encode


def test_hop_prints_and_records_sane_figures(tmp_path, capsys):
    out = tmp_path / "hop.jsonl"
    row = hop.main(
        ["--rounds", "30", "--idle-rounds", "3", "--idle-gap-ms", "2", "--warmup-s", "0"]
        + ["--out", str(out)]
    )
    printed = capsys.readouterr().out
    assert set(row["modes"]) == set(hop.MODES)
    for name, figures in row["modes"].items():
        assert name in printed
        assert set(figures) == {"b2b_p50_us", "b2b_p90_us", "idle_p50_us", "idle_p90_us"}
        for value in figures.values():
            assert isinstance(value, float) and math.isfinite(value) and value > 0, (name, value)
        assert figures["b2b_p90_us"] >= figures["b2b_p50_us"]
        assert figures["idle_p90_us"] >= figures["idle_p50_us"]
    assert "the process boundary adds" in printed
    assert json.loads(out.read_text().splitlines()[-1])["modes"] == row["modes"]


def test_round_trip_messages_are_the_servers():
    batch = hop.make_batch(3, 8)
    assert len(batch.rids) == len(set(batch.rids)) == len(batch.out_cache_loc) == 8
    assert decode(encode(batch), WORKER_INBOX) == batch


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_cpus_pins_the_run_and_restores_affinity(tmp_path):
    before = os.sched_getaffinity(0)
    cpu = min(before)
    row = hop.main(
        ["--rounds", "5", "--idle-rounds", "1", "--idle-gap-ms", "1", "--warmup-s", "0"]
        + ["--cpus", str(cpu), "--out", str(tmp_path / "hop.jsonl")]
    )
    assert row["cpus"] == [cpu]
    assert os.sched_getaffinity(0) == before
