"""A pool too small for the load: eviction and retraction happen, and outputs stay exact."""

from __future__ import annotations

import concurrent.futures
import random
import re
import time

import httpx
import pytest

from tests.conftest import mlx_greedy
from tests.server import ServerProcess

pytestmark = pytest.mark.slow


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def _workload(seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 512) for _ in range(30)]
    load = []
    for i in range(16):
        tail = [rng.randrange(3, 512) for _ in range(rng.randrange(5, 40))]
        load.append((shared + tail if i % 2 == 0 else tail, rng.randrange(20, 60)))
    return load


def test_small_pool_evicts_retracts_and_matches_mlx_lm(tiny_model, tmp_path):
    server = ServerProcess(
        tiny_model, tmp_path / "log", extra=["--max-total-tokens", "256", "--debug-invariants"]
    )
    server.start()
    try:
        for seed in range(3):
            load = _workload(seed)

            def run(item, url=server.url):
                prompt, n = item
                body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
                return httpx.post(url + "/v1/completions", json=body, timeout=300).json()

            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                results = list(pool.map(run, load))
            for (prompt, n), res in zip(load, results):
                assert "choices" in res, res
                assert res["choices"][0]["token_ids"] == mlx_greedy(tiny_model, prompt, n)
        metrics = _wait_idle(server)
        assert _metric(metrics, "radix_mlx_evicted_tokens_total") > 0
        assert _metric(metrics, "radix_mlx_retracted_requests_total") > 0
        assert _metric(metrics, "radix_mlx_kv_pool_capacity_tokens") == 256
        log = server.log()
        assert "Retract request" in log
        assert "Traceback" not in log and "two owners" not in log and "slots lost" not in log
    finally:
        assert server.stop() == 0


def _wait_idle(server: ServerProcess) -> str:
    """/metrics once the scheduler reports nothing running (checked with --debug-invariants)."""
    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(server.url + "/metrics").text
        idle = _metric(text, "radix_mlx_num_running_requests") == 0
        if idle and _metric(text, "radix_mlx_token_usage") == 0:
            return text
        assert time.monotonic() < deadline, text
        time.sleep(0.2)
