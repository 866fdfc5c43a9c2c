"""`radix-mlx serve --dp-size 2`: two real scheduler+worker pairs behind one router.

Where a request landed is read from `radix_mlx_replica_requests_total{replica}` around it
(requests are sent one at a time), what it reused from `usage.prompt_tokens_details`.
Servers: cache_aware and round_robin with 2 replicas, and one replica as the baseline;
the kill tests run last on the cache_aware server.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.metrics import METRICS
from tests.conftest import mlx_greedy
from tests.server import checked_server
from tests.test_faults import _body, _post_in_thread, _prompts, _stopped, _stream
from tests.test_metrics import PREFIX, delta, parse, scrape
from tests.test_routing import _groups

pytestmark = pytest.mark.slow
POOL = ["--max-total-tokens", "8192"]


@pytest.fixture(scope="module")
def cache_aware(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("dp2") / "server.log"
    with checked_server(tiny_model, log, [*POOL, "--dp-size", "2"]) as srv:
        yield srv


def _routed(url: str) -> dict[str, float]:
    m = scrape(url)
    key = PREFIX + 'replica_requests_total{replica="%s"}'
    return {r: m.get(key % r, 0.0) for r in ("r0", "r1")}


def _landed(before: dict[str, float], after: dict[str, float]) -> str:
    (replica,) = [r for r in after if after[r] != before[r]]
    return replica


def _complete(url: str, prompt: list[int], max_tokens: int) -> tuple[str, dict, list[int]]:
    """(replica it landed on, usage, token ids) of one greedy completion."""
    before = _routed(url)
    r = httpx.post(url + "/v1/completions", json=_body(prompt, max_tokens), timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    return _landed(before, _routed(url)), body["usage"], body["choices"][0]["token_ids"]


def _health(url: str) -> tuple[int, dict[str, str]]:
    r = httpx.get(url + "/health", timeout=5)
    return r.status_code, {rep["id"]: rep["state"] for rep in r.json()["replicas"]}


def _groups_share(url: str) -> tuple[float, dict[int, set[str]]]:
    """Cached-token share of 4 groups x 8 prompts (200-token shared prefixes), sent one by
    one in a shuffled order, and the replicas each group landed on."""
    cached = prompt = 0
    landed: dict[int, set[str]] = {}
    for group, ids in _groups(4, 8, seed=1):
        replica, usage, _ = _complete(url, ids, 2)
        cached += usage["prompt_tokens_details"]["cached_tokens"]
        prompt += usage["prompt_tokens"]
        landed.setdefault(group, set()).add(replica)
    return cached / prompt, landed


def test_health_lists_both_replicas_and_outputs_are_token_exact(cache_aware, tiny_model):
    assert _health(cache_aware.url) == (200, {"r0": "ready", "r1": "ready"})
    used = set()
    for prompt in _prompts(4, 7):  # distinct prompts: each goes to the emptier cache
        replica, _, ids = _complete(cache_aware.url, prompt, 8)
        used.add(replica)
        assert ids == mlx_greedy(tiny_model, prompt, 8)
    assert used == {"r0", "r1"}
    titles = {name: cache_aware.child(name) for name in ("worker-r0", "worker-r1")}
    assert len(set(titles.values())) == 2


def test_groups_stick_to_a_replica_and_cache_like_one_replica(
    cache_aware, tiny_model, tmp_path_factory
):
    share, landed = _groups_share(cache_aware.url)
    assert all(len(replicas) == 1 for replicas in landed.values()), landed
    assert {next(iter(r)) for r in landed.values()} == {"r0", "r1"}  # both replicas used
    m = scrape(cache_aware.url)
    assert m[PREFIX + 'routing_decisions_total{policy="cache_aware",reason="cache_hit"}'] >= 28
    log = tmp_path_factory.mktemp("dp-baselines")
    with checked_server(tiny_model, log / "one.log", POOL) as one:
        single, _ = _groups_share(one.url)
    with checked_server(
        tiny_model, log / "rr.log", [*POOL, "--dp-size", "2", "--routing-policy", "round_robin"]
    ) as rr:
        round_robin, rr_landed = _groups_share(rr.url)
    assert abs(share - single) <= 0.05 * single, (share, single)
    assert any(len(replicas) == 2 for replicas in rr_landed.values())
    assert round_robin < 0.95 * single, (round_robin, single)


@pytest.fixture(scope="module")
def tiny_pools(tiny_model, tmp_path_factory):
    """2 replicas of 512 slots each: a long generation evicts what the other prompts left."""
    log = tmp_path_factory.mktemp("dp2-tiny") / "server.log"
    with checked_server(tiny_model, log, ["--max-total-tokens", "512", "--dp-size", "2"]) as srv:
        yield srv


def _run(lo: int, n: int, rng: random.Random) -> list[int]:
    """n tokens from [lo, lo + 80): runs from disjoint ranges share no prefix by chance."""
    return [rng.randrange(lo, lo + 80) for _ in range(n)]


def test_routing_follows_what_a_replica_evicted(tiny_pools):
    """r0 caches P[:100] (and more), r1 only P[:60]; then a long generation on r0 evicts all
    of P there. A prompt starting with P[:100] goes to r1, which still holds P[:60]: had the
    router not been told of the eviction, r0's longer (stale) match would have won."""
    url, rng = tiny_pools.url, random.Random(5)
    p = _run(10, 100, rng)
    steps = [  # (prompt, max_tokens, where cache_aware sends it and why)
        (p + _run(90, 100, rng), 1, "r0"),  # both trees empty: the first
        (p[:60] + _run(170, 140, rng), 1, "r1"),  # a 30% match: below the threshold
        (p + _run(250, 60, rng), 1, "r0"),  # 63% of it on r0: a hit
        (p[:60] + _run(330, 140, rng), 1, "r1"),  # a miss: r1's tree is the smaller
        (_run(410, 40, rng), 420, "r0"),  # a miss to r0: 460 slots, so P goes from r0
    ]
    for prompt, max_tokens, expected in steps:
        replica, _, _ = _complete(url, prompt, max_tokens)
        assert replica == expected, (len(prompt), max_tokens)
    replica, usage, _ = _complete(url, p + _run(90, 10, rng), 1)
    assert replica == "r1" and usage["prompt_tokens_details"]["cached_tokens"] == 60


def test_scheduler_side_series_carry_the_replica_label(tiny_pools):
    """A real scrape with --dp-size 2: every scheduler-side sample is one replica's, and a
    request counts on the replica it landed on only."""
    # (collective_seconds: only a distributed worker's, test_distributed_e2e checks it)
    # (model_: a server with several models, router.serving.model_pool)
    router_side = ("process_", "routing_", "replica_", "collective_", "model_")
    per_replica = {PREFIX + n for n in METRICS if not n.startswith(router_side)}
    before = scrape(tiny_pools.url)
    prompt = _prompts(1, 41)[0]
    replica, _, _ = _complete(tiny_pools.url, prompt, 3)
    text = httpx.get(tiny_pools.url + "/metrics", timeout=10).text
    after = parse(text)
    for fam in text_string_to_metric_families(text):
        if fam.name in per_replica:
            assert fam.samples, fam.name
            assert {s.labels.get("replica") for s in fam.samples} <= {"r0", "r1"}, fam.name
    other = {"r0": "r1", "r1": "r0"}[replica]
    for name, expected in [
        ('prompt_tokens_total{replica="R"}', len(prompt)),
        ('generation_tokens_total{replica="R"}', 3),
        ('requests_total{finish_reason="length",replica="R"}', 1),
        ('time_to_first_token_seconds_count{replica="R"}', 1),
        ('e2e_request_latency_seconds_count{replica="R"}', 1),
    ]:
        key = PREFIX + name.replace('"R"', f'"{replica}"')
        assert delta(after, before, key) == expected, key
        assert delta(after, before, key.replace(replica, other)) == 0, key
    assert after[PREFIX + 'kv_pool_capacity_tokens{replica="r0"}'] == 512
    assert after[PREFIX + "kv_pool_capacity_tokens"] == 1024  # the sum: the server's pools


def _wait_state(url: str, replica: str, states: tuple[str, ...], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while _health(url)[1][replica] not in states:
        assert time.monotonic() < deadline, f"{replica} never {states}"
        time.sleep(0.05)


def test_killed_replica_fails_its_streams_the_other_serves_and_it_rejoins(cache_aware, tiny_model):
    url = cache_aware.url

    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            firsts = [asyncio.Event() for _ in range(8)]
            bodies = [_body(p, 300, stream=True) for p in _prompts(8, 21)]
            tasks = [asyncio.create_task(_stream(http, url, b, f))
                     for b, f in zip(bodies, firsts)]  # fmt: skip
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 30)
            os.kill(cache_aware.child("worker-r1"), signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    results = asyncio.run(run())
    failed = [error for ids, error in results if error is not None]
    served = [ids for ids, error in results if error is None]
    assert failed and served, results
    for error in failed:
        assert "replica r1" in error and "worker process exited with status -9" in error, error
    assert all(len(ids) == 300 for ids in served)
    status, states = _health(url)
    assert status == 200 and states["r0"] == "ready"
    if states["r1"] != "ready":  # while it restarts, new requests go to the survivor
        replica, _, _ = _complete(url, _prompts(1, 22)[0], 4)
        assert replica == "r0" or _health(url)[1]["r1"] == "ready"
    _wait_state(url, "r1", ("ready",))
    for prompt in _prompts(3, 23):  # its tree is empty now: new prefixes go there first
        replica, _, ids = _complete(url, prompt, 6)
        assert ids == mlx_greedy(tiny_model, prompt, 6)
        if replica == "r1":
            break
    assert replica == "r1"


def test_a_request_with_no_token_yet_is_retried_on_the_other_replica(cache_aware, tiny_model):
    url = cache_aware.url
    for prompt in _prompts(6, 31):  # a prefix r1 caches
        if _complete(url, prompt, 1)[0] == "r1":
            break
    else:
        pytest.fail("no prompt landed on r1")
    longer = prompt + [7, 8]  # it matches r1's tree: routed there
    before = _routed(url)
    worker = cache_aware.child("worker-r1")
    with _stopped(worker):  # r1 takes the request but computes nothing
        thread, out = _post_in_thread(url, _body(longer, 6))
        deadline = time.monotonic() + 10
        while _routed(url)["r1"] == before["r1"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(worker, signal.SIGKILL)
    thread.join(60)
    r = out["response"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == mlx_greedy(tiny_model, longer, 6)
    after = _routed(url)
    assert after["r1"] == before["r1"] + 1 and after["r0"] == before["r0"] + 1
    assert "on another replica: replica r1" in cache_aware.log()
    _wait_state(url, "r1", ("ready",))
