"""benchmarks/peers.py and the peers' place in benchmarks.serving: pins, commands, what
the benchmark reads back from a peer, and the "radix-mlx ÷ best peer" column.

Installing a peer takes minutes and gigabytes, so the one test that does is slow and
runs only with RADIX_MLX_BENCH_PEERS=1."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from benchmarks import peers
from benchmarks.records import INPROCESS, RequestResult, RunResult, WorkloadSpec
from benchmarks.report import BEST_PEER, comparison_table, compute_metrics
from benchmarks.serving import Endpoint, ManagedServer, make_sender, parse_args, plan_runs
from benchmarks.transports import HttpSender
from benchmarks.workloads import Clock

FREEZE = """\
mlx==0.32.4
mlx-cpu==0.32.4
mlx_lm==0.31.3
torch==2.13.0+cpu
torchvision==0.28.0
vllm-mlx==0.6.0
-e git+https://example.invalid/x.git@abc#egg=x
"""

# What rapid-mlx 0.16.10 streamed for a 3-token completion (recorded), as data: lines
RAPID_MLX_SSE = [
    '{"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": " c", '
    '"finish_reason": null}]}',
    '{"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "\\r", '
    '"finish_reason": null}]}',
    '{"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "f", '
    '"finish_reason": "length"}], "metrics": {"time_to_first_token_ms": 47.9}}',
    '{"id": "c", "object": "text_completion", "choices": [], "usage": {"prompt_tokens": 9, '
    '"completion_tokens": 3, "total_tokens": 12}}',
]


def test_versions_are_pinned_in_one_place():
    assert {p.requirement for p in peers.PEERS.values()} == {
        "vllm-mlx==0.6.0",
        "rapid-mlx==0.16.10",
    }
    assert "torch==2.13.0" in peers.PEER_PINS  # the CPU build on disk, not a CUDA one
    assert "mlx-lm==0.31.3" in peers.PEER_PINS
    assert peers.constraints_text().splitlines() == [
        "mlx==0.32.4",  # pip takes no extras in a constraints file
        "mlx-lm==0.31.3",
        "torch==2.13.0",
        "torchvision==0.28.0",
    ]
    for peer in peers.PEERS.values():
        assert peers.stamp_text(peer).splitlines() == [peer.requirement, *peers.PEER_PINS]


def test_install_puts_cpu_torch_first_then_the_peer_under_the_pins(tmp_path):
    peer = peers.PEERS["rapid-mlx"]
    venv = peers.venv_dir(peer, tmp_path)
    assert venv == tmp_path / "rapid-mlx-0.16.10"
    create, upgrade, torch, main = peers.install_commands(peer, venv)
    assert create == [sys.executable, "-m", "venv", str(venv)]
    assert upgrade[-2:] == ["--upgrade", "pip"]
    assert torch[-1] == "torch==2.13.0" and "-c" in torch
    assert main[0] == str(venv / "bin" / "python")
    assert main[main.index("-c") + 1] == str(venv / "pins.txt")
    assert main[-5:] == [peer.requirement, *peers.PEER_PINS]


def test_serve_commands_and_the_blas_they_get(tmp_path):
    vllm = peers.PEERS["vllm-mlx"]
    cmd = peers.serve_command(vllm, tmp_path, "/models/m", 8123)
    assert cmd == [str(tmp_path / "bin" / "vllm-mlx"), "serve", "/models/m", "--host",
                   "127.0.0.1", "--port", "8123", "--continuous-batching"]  # fmt: skip
    rapid = peers.serve_command(peers.PEERS["rapid-mlx"], tmp_path, "/models/m", 1)
    assert rapid[:2] == [str(tmp_path / "bin" / "rapid-mlx"), "serve"]
    assert "--disable-disk-caches" in rapid  # no prefix cache carried between fresh servers
    openblas = next((p for p in peers.OPENBLAS_PATHS if os.path.exists(p)), None)
    env = peers.blas_env()
    if openblas is None or sys.platform == "darwin":
        assert env == {}
    else:
        assert env["LD_PRELOAD"] == openblas


def test_a_peer_server_gets_openblas_and_a_home_of_its_own(tmp_path):
    server = ManagedServer("vllm-mlx", "/models/m", tmp_path, [])
    try:
        assert server.cmd[1:3] == ["serve", "/models/m"]
        assert server.cmd[server.cmd.index("--port") + 1] == str(server.port)
        assert server.env["HOME"] == server.hf_cache != os.environ.get("HOME")
        for key, value in peers.blas_env().items():
            assert server.env[key] == value
    finally:
        server.stop()
    assert not os.path.exists(server.hf_cache)


def test_pip_freeze_is_checked_against_the_pins():
    versions = peers.parse_freeze(FREEZE)
    assert versions["mlx-lm"] == "0.31.3" and versions["torch"] == "2.13.0+cpu"
    assert "x" not in versions
    assert peers.pin_mismatches(peers.PEERS["vllm-mlx"], versions) == []
    wrong = peers.pin_mismatches(peers.PEERS["rapid-mlx"], versions)
    assert wrong == ["rapid-mlx missing (pinned 0.16.10)"]
    versions["torch"] = "2.14.1"
    assert "torch 2.14.1 (pinned 2.13.0)" in peers.pin_mismatches(peers.PEERS["vllm-mlx"], versions)


def test_a_peer_stream_of_text_chunks_is_counted():
    """A peer streams text, no token ids: one token per non-empty chunk, the count from
    its usage chunk."""
    res, clock = RequestResult("request", 9, 3), Clock()
    for line in RAPID_MLX_SSE:
        HttpSender._event(json.loads(line), res, clock)
    assert res.output_text == " c\rf"
    assert res.output_len == 3 and res.reported_prompt_len == 9
    assert res.streamed_tokens is None and res.output_ids == []
    assert len(res.itls) == 2 and res.ttft > 0


def test_peers_get_text_prompts_and_vllm_mlx_the_model_name():
    async def senders():
        out = {}
        for backend in ("vllm-mlx", "rapid-mlx", "mlx-lm", "radix-mlx"):
            ep = Endpoint(backend, "http://127.0.0.1:9", model="/models/m")
            out[backend] = make_sender(ep, "http", 2)
            await out[backend].close()
        return out

    got = asyncio.run(senders())
    assert got["vllm-mlx"].text_prompts and got["vllm-mlx"].sampling == {"model": "/models/m"}
    assert got["rapid-mlx"].text_prompts and got["rapid-mlx"].sampling == {}
    assert got["mlx-lm"].text_prompts and not got["radix-mlx"].text_prompts


def test_the_standard_suite_runs_the_chosen_peers_and_the_replay():
    plan = plan_runs(parse_args(["--suite", "standard", "--peers", "rapid-mlx", "mlx-lm"]))
    by_load = {}
    for pr in plan:
        by_load.setdefault((pr.spec.key(), pr.max_concurrency), []).append(pr.backend)
    gsp = next(v for (k, _), v in by_load.items() if k.startswith("generated-shared-prefix"))
    assert gsp == ["radix-mlx", "radix-mlx-no-cache", INPROCESS, "rapid-mlx", "mlx-lm"]
    assert all("vllm-mlx" not in v for v in by_load.values())
    assert parse_args(["--backend", "mlx_lm.server"]).backend == ["mlx-lm"]
    assert parse_args(["--suite", "standard"]).peers == list(peers.PEER_BACKENDS)


def _run(backend: str, out_tok_s: float, itl_ms: float, step_ms: float | None = None):
    """A finished run of 4 requests whose output tok/s and ITL are the given ones."""
    reqs = []
    for _ in range(4):
        r = RequestResult("request", 10, 10, ok=True, output_len=10, ttft=0.01, latency=0.1)
        r.itls = [itl_ms / 1000] * 9
        reqs.append(r)
    spec = WorkloadSpec("random", dict(num_prompts=4))
    info = {"worker_decode_step_ms": step_ms}
    run = RunResult(backend, "http", spec, 4, float("inf"), 40 / out_tok_s, reqs, info)
    return run, compute_metrics(run)


def test_comparison_shows_radix_over_the_best_peer_and_the_serving_overhead():
    results = [
        _run("radix-mlx", 500, 8.0),
        _run(INPROCESS, 625, 6.0, step_ms=4.0),
        _run("mlx-lm", 200, 10.0),
        _run("rapid-mlx", 250, 5.0),
        _run("vllm-mlx", 240, 6.0),
    ]
    table = comparison_table(results)
    head, _, *rows = table.splitlines()
    assert head.rstrip().endswith(BEST_PEER)
    out_row = next(r for r in rows if r.strip().startswith("output tok/s"))
    assert out_row.split()[-1] == "2.00x"  # 500 / rapid-mlx's 250, the best peer's
    itl_row = next(r for r in rows if r.strip().startswith("ITL p50"))
    assert itl_row.split()[-1] == "1.60x"  # against the same peer: 8 / 5
    assert "best peer (by output tok/s): rapid-mlx" in table
    line = next(r for r in rows if "serving overhead" in r)
    assert "output tok/s 0.80x" in line  # 500 / 625
    assert "worker decode step 2.00x (step 4.00 ms)" in line  # 8 / 4


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("RADIX_MLX_BENCH_PEERS") != "1",
    reason="installs the peers (minutes, GBs): set RADIX_MLX_BENCH_PEERS=1",
)
def test_each_peer_installs_serves_and_is_measured(tmp_path):
    import subprocess

    out = tmp_path / "serving.jsonl"
    cmd = [sys.executable, "-m", "benchmarks.serving", "--backend", *peers.PEERS,
           "--preset", "tiny", "--workload", "random", "--num-prompts", "4",
           "--random-input-len", "32", "--random-output-len", "8", "--max-concurrency", "2",
           "--no-plots", "--no-progress", "--output-dir", str(tmp_path),
           "--result-file", str(out)]  # fmt: skip
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["backend"] for r in rows) == sorted(peers.PEERS)
    assert all(r["completed"] == 4 and r["failed"] == 0 for r in rows)


def test_targets_against_the_best_peer_and_the_replay():
    from benchmarks.summary import STANDARD_TARGETS, check_targets

    results = []
    for repeat, (ours, local, rapid, vllm) in enumerate(
        [(500, 520, 250, 300), (450, 500, 300, 200)]
    ):
        for backend, tok_s in (("radix-mlx", ours), (INPROCESS, local), ("rapid-mlx", rapid),
                               ("vllm-mlx", vllm)):  # fmt: skip
            run, m = _run(backend, tok_s, 8.0)
            run.workload, run.max_concurrency, run.repeat = WorkloadSpec("random"), 8, repeat
            results.append((run, m))
    mine = [t for t in STANDARD_TARGETS if t.workload == "random" and t.concurrency == 8]
    lines = {line.split("] ")[1].split(":")[0]: line for line in check_targets(results, mine)}
    # the best peer of each repeat: vllm-mlx (500 / 300), then rapid-mlx (450 / 300)
    best = lines["random c8 output tok/s ÷ best peer"]
    assert "[ met ]" in best and "repeats: 1.667, 1.500" in best
    assert "repeats: 0.962, 0.900" in lines["random c8 output tok/s HTTP ÷ in-process"]
    assert "n/a" in lines["random c8 output tok/s ÷ mlx-lm"]  # mlx_lm.server did not run
