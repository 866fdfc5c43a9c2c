"""Distributed workers end to end: `radix-mlx serve --tp-size 2` and `--pp-size 2` on the
tiny Qwen3 and the tiny Llama (grouped-query attention), two rank processes joined by
mx.distributed's ring on loopback, must generate exactly what single-process mlx-lm
generates in every scheduling situation, and a rank that dies takes the group down and
back up with it.

One server per (mode, model); several scenarios each. A small pool (--max-total-tokens
512) makes the later scenarios evict, and small chunks (--chunked-prefill-size 24,
--prefill-step-size 16) split prompts into several prefill steps and passes, the cases
where a pipeline stage could skip a send its neighbour waits for.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess

import httpx
import pytest

from router.client import AsyncClient, Client
from tests.conftest import mlx_greedy
from tests.server import RADIX_MLX, ReplicaProcess, ServerProcess, checked_server
from tests.test_faults import _body, _stream, wait_healthy
from tests.test_metrics import PREFIX, scrape, wait_idle

GREEDY = dict(temperature=0.0, ignore_eos=True)
EXTRA = ["--max-total-tokens", "512", "--chunked-prefill-size", "24", "--prefill-step-size", "16"]
MODES = [("tp", "tiny_model"), ("tp", "tiny_llama"), ("pp", "tiny_model"), ("pp", "tiny_llama")]


@pytest.fixture(scope="module", params=MODES, ids=lambda m: f"{m[0]}-{m[1]}")
def group(request, tmp_path_factory):
    mode, fixture = request.param
    model = request.getfixturevalue(fixture)
    log = tmp_path_factory.mktemp(f"dist-{mode}") / "server.log"
    flags = [f"--{mode}-size", "2", *EXTRA, "--watchdog-timeout", "60"]
    with checked_server(model, log, flags) as srv:
        yield srv, model, mode


def _prompts(n: int, seed: int, low: int = 4, high: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(low, high))] for _ in range(n)]


def test_start_up_names_every_rank_and_its_share(group):
    srv, _, mode = group
    log = srv.log()
    kind = "tensor" if mode == "tp" else "pipeline"
    for rank in (0, 1):
        assert f"rank {rank} of 2 ({kind} parallel, backend ring) on 127.0.0.1 holds" in log
    assert srv.child("worker") and srv.child("worker-1")
    if "OpenBLAS" in log and "OPENBLAS_NUM_THREADS" not in os.environ:  # the cores split
        threads = max(1, len(os.sched_getaffinity(0)) // 2)
        assert log.count(f", {threads} thread(s))") == 2, log


def test_cold_repeat_shared_prefix_and_multi_turn_are_token_exact(group):
    srv, model, _ = group
    base = _prompts(1, 1, 40, 41)[0]
    with Client(srv.zmq_address, timeout=120) as client:
        cold = client.generate(input_ids=base, max_new_tokens=10, **GREEDY)
        assert cold.output_ids == mlx_greedy(model, base, 10)
        again = client.generate(input_ids=base, max_new_tokens=10, **GREEDY)
        assert again.output_ids == cold.output_ids
        assert again.usage.cached_tokens == len(base) - 1
        shared = base[:30] + [7, 8, 9]
        res = client.generate(input_ids=shared, max_new_tokens=10, **GREEDY)
        assert res.output_ids == mlx_greedy(model, shared, 10)
        assert res.usage.cached_tokens >= 24  # at least the chunks cached whole
        # the next turn's prompt holds the first turn's generated tokens: read from the
        # pool, so they must have been flushed there on every rank
        turn2 = base + cold.output_ids + [11, 12]
        res = client.generate(input_ids=turn2, max_new_tokens=10, **GREEDY)
        assert res.output_ids == mlx_greedy(model, turn2, 10)
        assert res.usage.cached_tokens >= len(base)


def test_eight_concurrent_mixed_requests_are_token_exact(group):
    srv, model, _ = group
    prompts = _prompts(8, 2)
    lengths = [4 + 3 * i for i in range(8)]

    async def run():
        async with AsyncClient(srv.zmq_address, timeout=180) as client:
            return await asyncio.gather(*(
                client.generate(input_ids=p, max_new_tokens=n, **GREEDY)
                for p, n in zip(prompts, lengths)
            ))  # fmt: skip

    for res, p, n in zip(asyncio.run(run()), prompts, lengths):
        assert res.output_ids == mlx_greedy(model, p, n)


def test_a_pool_smaller_than_the_work_evicts_and_stays_exact(group):
    srv, model, _ = group
    prompts = _prompts(10, 3, 40, 60)  # ~600 prompt tokens through a 512-token pool
    with Client(srv.zmq_address, timeout=120) as client:
        for p in prompts:
            assert client.generate(input_ids=p, max_new_tokens=6, **GREEDY).output_ids == (
                mlx_greedy(model, p, 6)
            )
    assert scrape(srv.url)[PREFIX + "evicted_tokens_total"] > 0


def test_http_completion_is_token_exact(group):
    srv, model, _ = group
    prompt = _prompts(1, 4)[0]
    r = httpx.post(srv.url + "/v1/completions", json=_body(prompt, 8), timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == mlx_greedy(model, prompt, 8)


def test_metrics_time_the_decode_steps_collectives(group):
    srv, _, _ = group
    with Client(srv.zmq_address, timeout=120) as client:
        client.generate(input_ids=[5, 6, 7], max_new_tokens=4, **GREEDY)
    wait_idle(srv.url, timeout=30)
    metrics = scrape(srv.url)
    assert metrics[PREFIX + "collective_seconds_count"] >= 1
    assert 0 < metrics[PREFIX + "collective_seconds_sum"] < 60


def test_killing_a_rank_mid_decode_restarts_the_whole_group(group):
    srv, model, _ = group
    old = {name: srv.child(name) for name in ("worker", "worker-1")}

    async def run():
        async with httpx.AsyncClient(timeout=120) as http:
            first = asyncio.Event()
            task = asyncio.create_task(_stream(http, srv.url, _body([5, 6, 7], 400, True), first))
            await asyncio.wait_for(first.wait(), 60)
            os.kill(old["worker-1"], signal.SIGKILL)
            return await asyncio.wait_for(task, 60)

    ids, error = asyncio.run(run())
    assert len(ids) < 400
    assert error is not None and "worker-1 process exited with status -9" in error, error
    wait_healthy(srv, timeout=180)
    new = {name: srv.child(name) for name in ("worker", "worker-1")}
    assert not set(new.values()) & set(old.values())  # rank 0 went down with rank 1
    for pid in old.values():  # and no old rank is left running
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid)
    prompt = _prompts(1, 5)[0]
    r = httpx.post(srv.url + "/v1/completions", json=_body(prompt, 8), timeout=120)
    assert r.json()["choices"][0]["token_ids"] == mlx_greedy(model, prompt, 8)
    wait_idle(srv.url, timeout=30)


def test_a_remote_replica_of_tensor_parallel_ranks_is_token_exact(tiny_model, tmp_path):
    """`radix-mlx replica --tp-size 2` behind a router of no local replica: the replica
    supervises its ranks as `serve` does, and the router sees one replica."""
    replica = ReplicaProcess(tiny_model, tmp_path / "replica.log", extra=["--tp-size", "2"])
    replica.start()
    try:
        flags = ["--dp-size", "0", "--replica", replica.address]
        with checked_server(tiny_model, tmp_path / "router.log", flags) as srv:
            with Client(srv.zmq_address, timeout=120) as client:
                for p in _prompts(3, 6):
                    res = client.generate(input_ids=p, max_new_tokens=8, **GREEDY)
                    assert res.output_ids == mlx_greedy(tiny_model, p, 8)
            states = [r["state"] for r in httpx.get(srv.url + "/health").json()["replicas"]]
            assert states == ["ready"]
    finally:
        replica.stop()
    assert "rank 1 of 2 (tensor parallel" in replica.log()
    assert "Traceback" not in replica.log()


def _zombie(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _serve_refused(model: str, *flags: str) -> list[str]:
    out = subprocess.run(
        [RADIX_MLX, "serve", "--model-path", model, *flags],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-2000:]
    return [line for line in out.stderr.splitlines() if "] " in line and "router]" in line]


def test_a_model_class_with_mlx_lms_pipeline_uses_it_and_stays_exact(tiny_arch, tmp_path):
    """Qwen2's body has mlx-lm's pipeline(group) (rank 0 holds the last layers and the
    body sends, receives and gathers itself): cold, cached and concurrent stay exact."""
    model = tiny_arch("qwen2")
    flags = ["--pp-size", "2", *EXTRA, "--watchdog-timeout", "60"]
    with checked_server(model, tmp_path / "server.log", flags) as srv:
        assert "(mlx-lm's pipeline)" in srv.log()
        prompts = _prompts(6, 5)

        async def run():
            async with AsyncClient(srv.zmq_address, timeout=180) as client:
                return await asyncio.gather(*(
                    client.generate(input_ids=p, max_new_tokens=8, **GREEDY) for p in prompts
                ))  # fmt: skip

        for res, p in zip(asyncio.run(run()), prompts):
            assert res.output_ids == mlx_greedy(model, p, 8)
        with Client(srv.zmq_address, timeout=120) as client:
            again = client.generate(input_ids=prompts[0], max_new_tokens=8, **GREEDY)
        assert again.output_ids == mlx_greedy(model, prompts[0], 8)
        assert again.usage.cached_tokens == len(prompts[0]) - 1


def test_heads_that_do_not_divide_are_refused_with_one_line(tiny_model):
    lines = _serve_refused(tiny_model, "--tp-size", "3")
    errors = [line for line in lines if "do not divide" in line]
    assert len(errors) == 1, lines
    assert (
        "--tp-size 3: the model's 4 attention heads do not divide into 3 equal shares" in errors[0]
    )


def test_tp_and_pp_together_are_refused_with_one_line(tiny_model):
    lines = _serve_refused(tiny_model, "--tp-size", "2", "--pp-size", "2")
    assert any("--tp-size and --pp-size cannot both be above 1" in line for line in lines), lines


def test_under_mlx_launch_each_machine_runs_its_rank(tiny_model, tmp_path):
    """The multi-machine path on one machine: two `radix-mlx serve` commands with the env
    mlx.launch gives each host (MLX_RANK, MLX_HOSTFILE); rank 0's serves HTTP, rank 1's
    runs its rank only and fetches its descriptors from rank 0 over TCP."""
    from common.distributed_plan import loopback_hostfile
    from common.ipc import free_ports

    ring, hosts = tmp_path / "ring.json", tmp_path / "hosts.json"
    ring.write_text(json.dumps(loopback_hostfile(free_ports(2))))
    hosts.write_text(json.dumps([{"ssh": "localhost", "ips": ["127.0.0.1"]}] * 2))
    fanout = free_ports(1)[0]
    flags = ["--tp-size", "2", "--dist-hostfile", str(hosts), "--dist-port", str(fanout),
             "--max-total-tokens", "2048"]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", MLX_HOSTFILE=str(ring))
    with open(tmp_path / "rank1.log", "w") as log:
        other = subprocess.Popen(
            [RADIX_MLX, "serve", "--model-path", tiny_model, *flags],
            env=dict(env, MLX_RANK="1"), stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    srv = ServerProcess(tiny_model, tmp_path / "rank0.log", extra=flags)
    srv.env.update(MLX_RANK="0", MLX_HOSTFILE=str(ring))
    try:
        srv.start(timeout=180)
        prompt = _prompts(1, 6)[0]
        r = httpx.post(srv.url + "/v1/completions", json=_body(prompt, 8), timeout=120)
        assert r.json()["choices"][0]["token_ids"] == mlx_greedy(tiny_model, prompt, 8)
        assert "rank 1 of 2 (tensor parallel" in (tmp_path / "rank1.log").read_text()
    finally:
        srv.stop()
        other.terminate()
        other.wait(30)
