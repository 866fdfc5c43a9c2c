"""Metrics: the Metrics class, a live /metrics, the deploy/ files, and a real Prometheus.

Helpers `scrape`, `wait_for` and `wait_idle` are shared with the other end-to-end API tests.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.ipc import free_ports
from common.messages import DiskReport, SchedulerReady, SchedulerStats, TokenOut
from router.metrics import FINISH_REASONS, METRICS, PREFIX, PROCESSES, Metrics, exported_series
from tests.server import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana-dashboard.json"
PROMETHEUS_YML = ROOT / "deploy" / "prometheus.yml"

# The design brief's list, verbatim: (name, type).
BRIEF = [
    ("prompt_tokens_total", "counter"),
    ("generation_tokens_total", "counter"),
    ("cached_tokens_total", "counter"),
    ("requests_total", "counter"),
    ("evicted_tokens_total", "counter"),
    ("retracted_requests_total", "counter"),
    ("time_to_first_token_seconds", "histogram"),
    ("inter_token_latency_seconds", "histogram"),
    ("e2e_request_latency_seconds", "histogram"),
    ("queue_time_seconds", "histogram"),
    ("num_running_requests", "gauge"),
    ("num_queued_requests", "gauge"),
    ("token_usage", "gauge"),
    ("kv_pool_capacity_tokens", "gauge"),
]
RUNNING = PREFIX + "num_running_requests"
QUEUED = PREFIX + "num_queued_requests"
USAGE = PREFIX + "token_usage"


# ---------------------------------------------------------------- helpers


def _key(name: str, labels: dict) -> str:
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def parse(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{label="v"}': value}, plus, for the series labeled by
    replica, their sum over replicas under the key without that label (PromQL's `sum
    without (replica)`: the server's total; for token usage, 0 when every pool is idle)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[_key(s.name, s.labels)] = s.value
            if "replica" in s.labels:
                total = _key(s.name, {k: v for k, v in s.labels.items() if k != "replica"})
                out[total] = out.get(total, 0.0) + s.value
    return out


def scrape(url: str) -> dict[str, float]:
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200
    return parse(r.text)


def wait_for(url: str, cond, timeout: float = 8.0, what: str = "condition") -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if cond(m):
            return m
        if time.monotonic() > deadline:
            state = {k: v for k, v in m.items() if k in (RUNNING, QUEUED, USAGE)}
            raise AssertionError(f"timed out waiting for {what}: {state}")
        time.sleep(0.1)


def wait_running(url: str, timeout: float = 8.0) -> dict[str, float]:
    return wait_for(url, lambda m: m[RUNNING] >= 1, timeout, "a running request")


def wait_idle(url: str, timeout: float = 6.0) -> dict[str, float]:
    """The scheduler reports no running or queued request and no slot held by one (its
    stats arrive every 0.5 s while busy, about every second when idle)."""
    return wait_for(
        url,
        lambda m: m[RUNNING] == 0 and m[QUEUED] == 0 and m[USAGE] == 0,
        timeout,
        "the scheduler to free every slot",
    )


def delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def dashboard_exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


# ---------------------------------------------------------------- unit: Metrics


def _out(rid, ids, finish=None, prompt=10, cached=0, queue_time=0.0) -> TokenOut:
    return TokenOut(rid, ids, finish, prompt, len(ids), cached, queue_time=queue_time)


def _value(m: Metrics, name: str, **labels) -> float:
    """The sum of the samples of `name` that have `labels` (and any others)."""
    return sum(
        s.value
        for fam in m.registry.collect()
        for s in fam.samples
        if s.name == PREFIX + name and labels.items() <= s.labels.items()
    )


def test_brief_metric_names_and_types_are_registered():
    fams = {f.name: f.type for f in text_string_to_metric_families(Metrics().render()[0].decode())}
    for name, kind in BRIEF:
        family = PREFIX + name.removesuffix("_total")
        assert fams.get(family) == kind, (name, fams.get(family))
    assert {f for f in fams if not f.endswith("_created")} == {PREFIX + n for n in METRICS}


def test_queue_time_observed_once_per_request():
    m = Metrics()
    m.observe_output(_out("a", [1], queue_time=0.25), time.monotonic())
    m.observe_output(_out("a", [2], queue_time=9.0), time.monotonic())
    m.observe_output(_out("a", [3], "length"), time.monotonic())
    assert _value(m, "queue_time_seconds_count") == 1
    assert _value(m, "queue_time_seconds_sum") == pytest.approx(0.25)
    assert _value(m, "time_to_first_token_seconds_count") == 1
    assert _value(m, "inter_token_latency_seconds_count") == 2
    assert _value(m, "generation_tokens_total") == 3
    assert _value(m, "requests_total", finish_reason="length") == 1
    m.forget("a")  # the manager always forgets; a finished request is not counted twice
    assert _value(m, "requests_total", finish_reason="abort") == 0
    assert _value(m, "e2e_request_latency_seconds_count") == 1


def test_router_ended_requests_count_as_stop_or_abort():
    m = Metrics()
    now = time.monotonic()
    m.observe_output(_out("gone", [1, 2]), now)
    m.forget("gone")  # client went away
    m.observe_output(_out("stopped", [1]), now)
    m.note_finish("stopped", "stop")  # a stop string matched on the text
    m.forget("stopped")
    m.forget("never-started")  # aborted before any output: not seen, not counted
    m.note_finish("unknown", "stop")
    assert _value(m, "requests_total", finish_reason="abort") == 1
    assert _value(m, "requests_total", finish_reason="stop") == 1
    assert _value(m, "e2e_request_latency_seconds_count") == 1  # the stop, not the abort
    assert m._live == {}


def test_scheduler_stats_become_gauges_and_counter_increments():
    m = Metrics()
    m.observe_stats(SchedulerStats(3, 2, 0.5, 1024, 100, 1))
    m.observe_stats(SchedulerStats(1, 0, 0.25, 1024, 160, 1))
    assert _value(m, "num_running_requests") == 1
    assert _value(m, "num_queued_requests") == 0
    assert _value(m, "token_usage") == 0.25
    assert _value(m, "kv_pool_capacity_tokens") == 1024
    assert _value(m, "evicted_tokens_total") == 160
    assert _value(m, "retracted_requests_total") == 1


def test_scheduler_side_series_are_per_replica_and_sum_to_the_server():
    m = Metrics()
    for replica in ("r0", "r1"):
        m.observe_ready(SchedulerReady(1024, 16, 4096, "qwen3"), replica)
    m.observe_stats(SchedulerStats(3, 2, 0.5, 1024, 100, 1), "r0")
    m.observe_stats(SchedulerStats(1, 0, 0.25, 1024, 40, 0), "r1")
    m.observe_output(_out("a", [1], prompt=10, cached=4), time.monotonic(), "r1")
    m.observe_output(_out("a", [2], "length"), time.monotonic(), "r1")
    assert _value(m, "num_running_requests", replica="r0") == 3
    assert _value(m, "num_running_requests") == 4
    assert _value(m, "kv_pool_capacity_tokens") == 2048
    assert _value(m, "evicted_tokens_total", replica="r1") == 40
    assert _value(m, "cached_tokens_total", replica="r1") == 4
    assert _value(m, "cached_tokens_total", replica="r0") == 0
    assert _value(m, "requests_total", finish_reason="length", replica="r1") == 1
    assert _value(m, "time_to_first_token_seconds_count", replica="r1") == 1
    m.observe_death("worker", "r0")  # nothing runs there while it restarts
    assert _value(m, "num_running_requests") == 1
    # (collective_seconds: only a distributed worker's, test_distributed_e2e checks it)
    # (embedding_*: the embeddings endpoint's, per replica too but not the brief's; the disk
    # tier's: test_disk_tier_series below)
    others = (
        "process_", "routing_", "replica_", "collective_", "model_", "embedding_", "kv_disk_",
        "cache_hit_", "vision_",
    )  # fmt: skip
    per_replica = {n for n in METRICS if not n.startswith(others)}
    assert per_replica == {name.removesuffix("_total") for name, _ in BRIEF}
    m.observe_embedding(12, "r1")
    assert _value(m, "embedding_tokens_total", replica="r1") == 12
    assert _value(m, "embedding_requests_total") == 1
    for fam in m.registry.collect():
        if fam.name.removeprefix(PREFIX) in per_replica | {
            "embedding_requests",
            "embedding_tokens",
        }:
            assert fam.samples, fam.name
            assert all(s.labels.get("replica") in ("r0", "r1") for s in fam.samples), fam.name


def test_vision_tower_series():
    """The worker's cumulative tower runs and cache hits become counters that only grow:
    a restarted replica's counts start again from 0 and add to them."""
    m = Metrics()

    def stats(runs: int, hits: int) -> SchedulerStats:
        return SchedulerStats(0, 0, 0.0, 1024, 0, 0, vision_tower_runs=runs, vision_cache_hits=hits)

    m.observe_stats(stats(2, 1))
    m.observe_stats(stats(3, 4))
    assert _value(m, "vision_tower_runs_total") == 3
    assert _value(m, "vision_cache_hits_total") == 4
    m.observe_ready(SchedulerReady(1024, 16, 4096, "qwen2_5_vl"))
    m.observe_stats(stats(1, 0))
    assert _value(m, "vision_tower_runs_total") == 4
    assert _value(m, "vision_cache_hits_total") == 4


def test_disk_tier_series():
    """The worker's DiskReports set the gauges and add their errors and timings; a
    request's first output splits its cached tokens into the pool's and the disk's."""
    m = Metrics()
    m.observe_ready(SchedulerReady(1024, 16, 4096, "qwen3"), "r0")
    assert _value(m, "kv_disk_errors_total", reason="checksum") == 0  # exported at 0
    m.observe_disk(DiskReport(4096, 2, {"checksum": 1}, [0.002], [0.01, 0.02]), "r0")
    m.observe_disk(DiskReport(8192, 3, {"checksum": 2}, [], [0.01]), "r0")
    assert _value(m, "kv_disk_bytes", replica="r0") == 8192
    assert _value(m, "kv_disk_blocks") == 3
    assert _value(m, "kv_disk_errors_total", reason="checksum") == 3
    assert _value(m, "kv_disk_read_seconds_count") == 1
    assert _value(m, "kv_disk_write_seconds_count") == 3
    out = _out("a", [1], prompt=300, cached=256)
    out.disk_cached_tokens = 192
    m.observe_output(out, time.monotonic(), "r0")
    assert _value(m, "cache_hit_tokens_total", tier="disk") == 192
    assert _value(m, "cache_hit_tokens_total", tier="pool") == 64
    assert _value(m, "cached_tokens_total") == 256


# ---------------------------------------------------------------- deploy/ files


def test_dashboard_queries_only_exported_metrics():
    board = json.loads(DASHBOARD.read_text())
    names = {v["name"] for v in board["templating"]["list"]}
    assert "datasource" in names
    ds_var = next(v for v in board["templating"]["list"] if v["name"] == "datasource")
    assert ds_var["type"] == "datasource" and ds_var["query"] == "prometheus"
    exported = exported_series()
    exprs = dashboard_exprs()
    assert len(exprs) >= 15
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    for expr in exprs:
        used = set(re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*(?=\s*[{\[)])", expr))
        metrics = {n for n in used if n.startswith(PREFIX)}
        assert metrics, expr
        assert metrics <= exported, (expr, metrics - exported)
        others = used - metrics - _PROMQL_WORDS
        assert not others, (expr, others)
    joined = "\n".join(exprs)
    for needed in [
        "histogram_quantile(0.99, sum by (le) (rate(radix_mlx_time_to_first_token_seconds_bucket",
        "rate(radix_mlx_inter_token_latency_seconds_bucket",
        "rate(radix_mlx_e2e_request_latency_seconds_bucket",
        "sum(rate(radix_mlx_cached_tokens_total",
        "rate(radix_mlx_generation_tokens_total",
        "radix_mlx_token_usage",
        "radix_mlx_num_queued_requests",
        "radix_mlx_num_running_requests",
        "sum by (finish_reason) (rate(radix_mlx_requests_total",
        "sum by (process) (increase(radix_mlx_process_restarts_total",
        "min by (process) (radix_mlx_process_up",
    ]:
        assert needed in joined, needed
    hit = next(e for e in exprs if "cached_tokens_total" in e)
    assert re.search(r"cached_tokens_total.*\[1m\]\)\) / sum\(rate\(radix_mlx_prompt_tokens", hit)


_PROMQL_WORDS = {
    "histogram_quantile",
    "sum",
    "min",
    "rate",
    "increase",
    "by",
    "le",
    "finish_reason",
    "process",
    "replica",
    "policy",
    "reason",
    "tier",
    "max",
    "instance",
}


def test_prometheus_yml_scrapes_the_local_server():
    yaml = pytest.importorskip("yaml")
    cfg = yaml.safe_load(PROMETHEUS_YML.read_text())
    (job,) = cfg["scrape_configs"]
    assert job["job_name"] == "radix-mlx"
    assert job["metrics_path"] == "/metrics"
    assert job["scrape_interval"] == "5s"
    assert job["static_configs"] == [{"targets": ["127.0.0.1:30000"]}]


# ---------------------------------------------------------------- a live server


def _complete(url: str, prompt, max_tokens: int, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body | extra, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_live_metrics_move_as_requests_run(tiny_server):
    url = tiny_server.url
    prompt = [random.Random(7).randrange(3, 500) for _ in range(40)]
    n = 6
    before = scrape(url)
    first = _complete(url, prompt, n)
    second = _complete(url, prompt, n)
    after = scrape(url)
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompt) - 1
    p = PREFIX
    assert delta(after, before, p + "cached_tokens_total") >= len(prompt) - 1
    assert delta(after, before, p + "prompt_tokens_total") == 2 * len(prompt)
    assert delta(after, before, p + "generation_tokens_total") == 2 * n
    assert delta(after, before, p + 'requests_total{finish_reason="length"}') == 2
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta(after, before, p + hist + "_count") == 2, hist
        assert delta(after, before, p + hist + "_sum") > 0, hist
    assert delta(after, before, p + "queue_time_seconds_count") == 2
    itl = delta(after, before, p + "inter_token_latency_seconds_count")
    assert 0 < itl <= 2 * (n - 1)
    bucket_inf = p + 'inter_token_latency_seconds_bucket{le="+Inf"}'
    assert delta(after, before, bucket_inf) == itl
    assert after[p + "kv_pool_capacity_tokens"] == 8192
    text = httpx.get(url + "/metrics").text
    fams = {f.name: f.type for f in text_string_to_metric_families(text)}
    for name, kind in BRIEF:
        assert fams.get(PREFIX + name.removesuffix("_total")) == kind, name


@pytest.mark.slow
def test_first_scrape_has_every_known_series_at_zero(tiny_model, tmp_path):
    """Before any request, a fresh server with two replicas exports each replica's
    series (tokens, requests by finish reason, latency histograms, gauges) at 0, and
    each process's: `rate()` has data and `absent()` stays quiet on an idle server."""
    server = ServerProcess(tiny_model, tmp_path / "log",
                           extra=["--max-total-tokens", "4096", "--dp-size", "2"])  # fmt: skip
    server.start()
    try:
        m = wait_for(server.url, lambda m: m.get(PREFIX + 'replica_up{replica="r1"}') == 1,
                     what="both replicas up")  # fmt: skip
    finally:
        server.stop()
    p = PREFIX
    for replica in ("r0", "r1"):
        r = f'replica="{replica}"'
        for name in ("prompt_tokens_total", "generation_tokens_total", "cached_tokens_total",
                     "evicted_tokens_total", "retracted_requests_total",
                     "replica_requests_total", "replica_restarts_total",
                     "num_running_requests", "num_queued_requests", "token_usage"):  # fmt: skip
            assert m.get(f"{p}{name}{{{r}}}") == 0, (name, replica)
        for reason in FINISH_REASONS:
            assert m.get(f'{p}requests_total{{finish_reason="{reason}",{r}}}') == 0, reason
        for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                     "e2e_request_latency_seconds", "queue_time_seconds"):  # fmt: skip
            assert m.get(f"{p}{hist}_count{{{r}}}") == 0, (hist, replica)
            assert m.get(f'{p}{hist}_bucket{{le="+Inf",{r}}}') == 0, (hist, replica)
        assert m.get(f"{p}kv_pool_capacity_tokens{{{r}}}") == 4096
    for process in PROCESSES:
        assert m.get(f'{p}process_up{{process="{process}"}}') == 1, process
    for process in ("scheduler", "worker"):
        assert m.get(f'{p}process_restarts_total{{process="{process}"}}') == 0, process


@pytest.mark.slow
def test_real_prometheus_scrapes_our_series(tiny_server, tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip(
            "the prometheus binary is not installed (Debian: apt-get install prometheus); "
            "the scrape config is still checked by test_prometheus_yml_scrapes_the_local_server"
        )
    target = tiny_server.url.removeprefix("http://")
    cfg = PROMETHEUS_YML.read_text().replace("127.0.0.1:30000", target)
    cfg = cfg.replace("scrape_interval: 5s", "scrape_interval: 1s")
    assert target in cfg
    (tmp_path / "prometheus.yml").write_text(cfg)
    (port,) = free_ports(1)
    api = f"http://127.0.0.1:{port}/api/v1"
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        _complete(tiny_server.url, [5, 6, 7, 8], 3)
        deadline = time.monotonic() + 40
        result = []
        while time.monotonic() < deadline and not result:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            try:
                r = httpx.get(api + "/query", params={"query": PREFIX + "kv_pool_capacity_tokens"})
                if r.status_code == 200:
                    result = r.json()["data"]["result"]
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        assert result, "Prometheus never returned our series"
        (series,) = result
        assert series["metric"]["job"] == "radix-mlx"
        assert series["metric"]["instance"] == target
        assert float(series["value"][1]) == 8192
        # Every dashboard query is valid PromQL for this Prometheus.
        for expr in dashboard_exprs():
            r = httpx.get(api + "/query", params={"query": expr.replace("$instance", ".*")})
            assert r.status_code == 200 and r.json()["status"] == "success", (expr, r.text)
        r = httpx.get(api + "/query", params={"query": PREFIX + "requests_total"})
        reasons = {s["metric"]["finish_reason"] for s in r.json()["data"]["result"]}
        assert {"length", "stop", "abort"} <= reasons
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
