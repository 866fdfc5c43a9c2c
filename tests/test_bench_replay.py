"""benchmarks.replay: a serving load through the scheduler and the worker in one process,
as `benchmarks.serving --backend radix-mlx-inprocess`, on the tiny model.

Run as a subprocess: the worker installs its CPU kernels into mlx-lm's modules for the
life of its process, which must not be the test process (other tests compare with
mlx-lm's own generation)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.records import INPROCESS

ROOT = Path(__file__).resolve().parents[1]


def _serve_load(tmp_path: Path, *workload: str) -> tuple[list[dict], str]:
    out = tmp_path / f"{workload[1]}.jsonl"
    cmd = [sys.executable, "-m", "benchmarks.serving", "--backend", INPROCESS,
           "--preset", "tiny", "--max-concurrency", "3", "--no-plots", "--no-progress",
           "--output-dir", str(tmp_path), "--result-file", str(out), *workload]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()], done.stdout


@pytest.mark.slow
def test_random_and_shared_prefix_loads_replay_in_process(tmp_path):
    (rnd,), printed = _serve_load(
        tmp_path, "--workload", "random", "--num-prompts", "6",
        "--random-input-len", "40", "--random-output-len", "7",
    )  # fmt: skip
    assert rnd["backend"] == INPROCESS and rnd["transport"] == "none"
    assert rnd["completed"] == 6 and rnd["failed"] == 0
    assert rnd["total_output_tokens"] == 6 * 7 and rnd["total_input_tokens"] == 6 * 40
    assert rnd["prompt_len_mismatches"] == rnd["stream_count_mismatches"] == 0
    assert rnd["short_outputs"] == 0  # ignore_eos holds: every request got all 7 tokens
    assert rnd["output_throughput"] == pytest.approx(42 / rnd["duration_s"])
    assert 0 < rnd["worker_decode_step_ms"] < rnd["median_e2e_ms"]
    assert "random[6-40-7-1.0] c3" in printed

    (gsp,), _ = _serve_load(
        tmp_path, "--workload", "generated-shared-prefix", "--gsp-num-groups", "2",
        "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "64",
        "--gsp-question-len", "8", "--gsp-output-len", "5",
    )  # fmt: skip
    assert gsp["completed"] == 6 and gsp["failed"] == 0
    assert gsp["cached_share"] > 0  # the radix cache works in the replay as in the server
