"""Gauges and scheduler-side counters are true at every scrape: the pool's capacity as soon
as /health says 200, a burst shorter than a second, an eviction right after it happened,
and one `up` gauge per process."""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest

from tests.server import ServerProcess
from tests.test_metrics import PREFIX, QUEUED, RUNNING, USAGE, parse, scrape

pytestmark = pytest.mark.slow
POOL = 1024


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("gauges") / "server.log"
    extra = ["--max-total-tokens", str(POOL), "--max-running-requests", "2"]
    srv = ServerProcess(tiny_model, log, extra=extra)
    srv.start()  # returns at the first /health 200
    yield srv
    srv.stop()


def _complete(server: ServerProcess, prompt: list[int], max_tokens: int) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_capacity_and_up_at_the_first_scrape(server):
    m = scrape(server.url)
    assert m[PREFIX + "kv_pool_capacity_tokens"] == POOL
    for process in ("router", "scheduler", "worker"):
        assert m[PREFIX + f'process_up{{process="{process}"}}'] == 1, process


def test_a_short_burst_shows_in_running_and_queued(server):
    rng = random.Random(0)
    jobs = [
        threading.Thread(target=_complete, args=(server, [rng.randrange(3, 500)] * 8, 30))
        for _ in range(6)
    ]
    seen = []
    started = time.monotonic()
    for job in jobs:
        job.start()
    with httpx.Client() as http:
        while any(job.is_alive() for job in jobs):
            r = http.get(server.url + "/metrics")
            seen.append(r.text)
    for job in jobs:
        job.join()
    burst = time.monotonic() - started
    samples = [parse(text) for text in seen]
    assert max(m[QUEUED] for m in samples) >= 1, (burst, len(samples))
    assert max(m[RUNNING] for m in samples) == 2
    m = scrape(server.url)
    assert (m[RUNNING], m[QUEUED], m[USAGE]) == (0, 0, 0)


def test_counters_are_current_right_after_the_load(server):
    rng = random.Random(1)
    for _ in range(6):  # 6 x 300 prompt tokens through a pool of 1024: the trie evicts
        _complete(server, [rng.randrange(3, 500) for _ in range(300)], 4)
    now = scrape(server.url)
    time.sleep(1.5)  # three of the scheduler's old 0.5 s stats periods
    later = scrape(server.url)
    evicted = PREFIX + "evicted_tokens_total"
    assert now[evicted] > 0
    for key in (evicted, PREFIX + "prompt_tokens_total", PREFIX + "cached_tokens_total",
                RUNNING, QUEUED, USAGE):  # fmt: skip
        assert now[key] == later[key], key
