"""A pool too small for the load: eviction and retraction happen, and outputs stay exact."""

from __future__ import annotations

import concurrent.futures
import random
import time

import httpx
import pytest

from tests.conftest import mlx_greedy
from tests.server import ServerProcess
from tests.test_metrics import parse

pytestmark = pytest.mark.slow


def _metric(text: str, name: str) -> float:
    """A series of the /metrics text, summed over replicas (tests.test_metrics.parse)."""
    series = parse(text)
    assert name in series, f"{name} missing from /metrics"
    return series[name]


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


SAMPLED = {"temperature": 0.9, "top_p": 0.9, "top_k": 0, "min_p": 0.02, "frequency_penalty": 0.5}
BAD = [
    ({"max_tokens": -3}, "max_tokens must be >= 1"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_k": -2}, "top_k must be"),
    ({"prompt": [7] * 40000}, "maximum context length"),  # a max_tokens beyond is cut
]


def _mixed_request(i: int, rng: random.Random, shared: list[int]) -> dict:
    """Request i of the mixed load: greedy, seeded sampling with penalties and logprobs,
    a stream its client drops after two chunks, or a bad request (one kind each)."""
    tail = [rng.randrange(3, 512) for _ in range(rng.randrange(3, 30))]
    body = {"prompt": shared + tail if i % 3 else tail, "max_tokens": rng.randrange(8, 40)}
    body["ignore_eos"] = True
    kind = ("greedy", "sampled", "dropped", "bad")[i % 4]
    if kind == "greedy":
        body["temperature"] = 0
    elif kind == "sampled":
        body.update(SAMPLED, seed=i, logprobs=2)
    elif kind == "dropped":
        body.update(stream=True, temperature=0)
    else:
        body.update(BAD[i // 4 % len(BAD)][0])
    return {"kind": kind, "body": body, "i": i}


def _send(url: str, req: dict):
    """The token ids (greedy, sampled), the error message (bad), or None (dropped)."""
    if req["kind"] == "dropped":
        with httpx.stream("POST", url + "/v1/completions", json=req["body"], timeout=300) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n >= 2:
                    return None  # leaving the block closes the connection mid-stream
        raise AssertionError("stream ended before the client dropped it")
    r = httpx.post(url + "/v1/completions", json=req["body"], timeout=300)
    if req["kind"] == "bad":
        assert r.status_code == 400, r.text
        return r.json()["error"]["message"]
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_mixed_traffic_with_drops_and_errors_loses_nothing(tiny_model, tmp_path):
    """Greedy, seeded-sampled, dropped and malformed requests interleaved on a pool that
    must evict and retract: greedy stays exact, a seeded request samples what it samples
    alone, bad ones get their message, and the dropped ones leave no slot behind."""
    server = ServerProcess(
        tiny_model, tmp_path / "log", extra=["--max-total-tokens", "256", "--debug-invariants"]
    )
    server.start()
    try:
        rng = random.Random(5)
        shared = [rng.randrange(3, 512) for _ in range(40)]
        load = [_mixed_request(i, rng, shared) for i in range(48)]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda r: _send(server.url, r), load))
        for req, got in zip(load, results):
            body = req["body"]
            if req["kind"] == "greedy":
                assert got == mlx_greedy(tiny_model, body["prompt"], body["max_tokens"])
            elif req["kind"] == "sampled":
                assert len(got) == body["max_tokens"]
                assert _send(server.url, req) == got, "seeded sampling depends on its batch"
            elif req["kind"] == "bad":
                assert BAD[req["i"] // 4 % len(BAD)][1] in got
        metrics = _wait_idle(server)
        assert _metric(metrics, "radix_mlx_evicted_tokens_total") > 0
        assert _metric(metrics, 'radix_mlx_requests_total{finish_reason="abort"}') > 0
        log = server.log()
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
