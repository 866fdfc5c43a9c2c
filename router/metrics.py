"""Prometheus metrics, all exposed by the router on the HTTP port.

The scheduler reports its gauges and cumulative counters in SchedulerStats messages
(whenever they change, at most once per scheduling step); the router measures latencies
itself, per request, from the outputs it routes, and its supervisor reports the
processes. One registry per server, so tests can run several. Every metric is in
`METRICS` below; labels stay low-cardinality (`finish_reason`, `process`, `replica`,
`policy`, `reason`).

Every series whose labels are known when the server starts is exported from the first
scrape, at 0 (Prometheus' advice on missing series: `rate()` of an absent series shows no
data and `absent()` alerts fire on a healthy idle server): each replica's as it is added
(`add_replica`), with each finish reason, and each process's.

Every scheduler-side series (token and request counters, latency histograms, gauges) has
a `replica` label: `r0`, `r1`, ... in --dp-size order, then the --replica ones; a single
replica is `r0`. The server's totals are their `sum` (token usage: `sum(token_usage *
kv_pool_capacity_tokens) / sum(kv_pool_capacity_tokens)`, the share of all pools). The
`replica_*` series are the router's view of each replica (up, restarts, requests routed)
and `routing_decisions_total{policy,reason}` counts the router's choices.
"""

from __future__ import annotations

import copy
import time
from collections.abc import AsyncIterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from common.messages import DiskReport, SchedulerReady, SchedulerStats, TokenOut
from router.disk_metrics import DISK_METRICS, DiskMetrics

PREFIX = "radix_mlx_"
# From a fast Mac (ms) to a slow CPU under load (minutes).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ROUTING_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2)
COLLECTIVE_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.5)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5)

# name (without prefix and without the counter's `_total`) -> Prometheus type
METRICS = {
    "prompt_tokens": "counter",
    "generation_tokens": "counter",
    "cached_tokens": "counter",
    "requests": "counter",
    "evicted_tokens": "counter",
    "retracted_requests": "counter",
    "time_to_first_token_seconds": "histogram",
    "inter_token_latency_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram",
    "queue_time_seconds": "histogram",
    "num_running_requests": "gauge",
    "num_queued_requests": "gauge",
    "token_usage": "gauge",
    "kv_pool_capacity_tokens": "gauge",
    "process_up": "gauge",
    "process_restarts": "counter",
    "routing_decisions": "counter",
    "routing_seconds": "histogram",
    "replica_up": "gauge",
    "replica_restarts": "counter",
    "replica_requests": "counter",
    "collective_seconds": "histogram",
    "model_loaded": "gauge",
    "model_load_seconds": "histogram",
    "model_evictions": "counter",
    "embedding_requests": "counter",
    "embedding_tokens": "counter",
    "vision_tower_runs": "counter",
    "vision_cache_hits": "counter",
    **DISK_METRICS,
}
FINISH_REASONS = ("stop", "length", "abort")
PROCESSES = ("router", "scheduler", "worker")


def exported_series() -> set[str]:
    """Every series name a scrape can contain (what PromQL may reference)."""
    names = set()
    for name, kind in METRICS.items():
        full = PREFIX + name
        if kind == "counter":
            names |= {full + "_total", full + "_created"}
        elif kind == "histogram":
            names |= {full + s for s in ("_bucket", "_count", "_sum", "_created")}
        else:
            names.add(full)
    return names


class _Live:
    """Per-request state between the first output and the end."""

    __slots__ = ("created", "last", "end_reason", "replica")

    def __init__(self, created: float, now: float, replica: str):
        self.created, self.last, self.replica = created, now, replica
        self.end_reason: str | None = None


class Metrics:
    """`models`: the server serves several models (router.serving.model_pool); every
    replica-labelled series then has a `model` label first, and each model's manager
    reports through its own view (`for_model`)."""

    def __init__(self, models: bool = False):
        self.registry = r = CollectorRegistry()
        self.model: str | None = None  # the model a view of `for_model` reports for
        label = ["model", "replica"] if models else ["replica"]
        p = PREFIX

        def counter(name: str, doc: str, labels=tuple(label)) -> Counter:
            return Counter(p + name, doc, list(labels), registry=r)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(p + name, doc, label, buckets=buckets, registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(p + name, doc, label, registry=r)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens from the prefix cache")
        self.requests = counter("requests", "Finished requests (abort: the client went away "
                                "or cancelled)", ("finish_reason", *label))  # fmt: skip
        self.evicted_tokens = counter("evicted_tokens", "Tokens evicted from the cache")
        self.retracted = counter("retracted_requests", "Requests retracted to the queue")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token",
                              LATENCY_BUCKETS)  # fmt: skip
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens",
                             ITL_BUCKETS)  # fmt: skip
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency", LATENCY_BUCKETS)
        self.queue_time = histogram("queue_time_seconds", "Time from arrival at the scheduler "
                                    "to the first prefill", LATENCY_BUCKETS)  # fmt: skip
        self.running = gauge("num_running_requests", "Running requests")
        self.queued = gauge("num_queued_requests", "Waiting requests")
        self.token_usage = gauge("token_usage", "KV pool share held by running requests")
        self.capacity = gauge("kv_pool_capacity_tokens", "KV pool size")
        self.up = Gauge(p + "process_up", "1 while the process serves", ["process"], registry=r)
        self.restarts = Counter(
            p + "process_restarts",
            "Restarts of the worker and scheduler, by the process that died or hung",
            ["process"],
            registry=r,
        )
        self._replica_metrics(r, label)
        self._model_metrics(r)  # no series unless several models are served
        # apart from prompt_tokens (generation's), whose share cached_tokens is
        self.embedding_requests = counter("embedding_requests", "Answered /v1/embeddings requests")
        self.embedding_tokens = counter("embedding_tokens", "Input tokens of embeddings")
        self.disk = DiskMetrics(r)
        self.tower_runs = counter("vision_tower_runs", "Images a vision model's tower computed")
        self.tower_hits = counter(
            "vision_cache_hits", "Images whose vision-tower output came from the tower cache"
        )
        self.collective = histogram(
            "collective_seconds",
            "A distributed worker's decode-step collectives, timed alone every 64 steps",
            COLLECTIVE_BUCKETS,
        )
        for process in PROCESSES:
            self.up.labels(process).set(process == "router")
            if process != "router":
                self.restarts.labels(process)
        self._stats: dict[tuple, SchedulerStats] = {}  # each replica's last report
        self._down: set[tuple] = set()  # replicas being restarted
        self._live: dict[str, _Live] = {}

    def _replica_metrics(self, r: CollectorRegistry, label: list[str]) -> None:
        p = PREFIX
        self.routing = Counter(p + "routing_decisions", "Requests routed to a replica, by "
                               "policy and why", ["policy", "reason"], registry=r)  # fmt: skip
        self.routing_time = Histogram(
            p + "routing_seconds", "CPU time the routing policy took to pick a replica",
            buckets=ROUTING_BUCKETS, registry=r,
        )  # fmt: skip
        self.replica_up = Gauge(p + "replica_up", "1 while the replica serves", label, registry=r)
        self.replica_restarts = Counter(
            p + "replica_restarts", "Restarts of the replica's worker and scheduler", label,
            registry=r,
        )  # fmt: skip
        self.replica_requests = Counter(
            p + "replica_requests", "Requests routed to the replica (retries included)", label,
            registry=r,
        )  # fmt: skip

    def _model_metrics(self, r: CollectorRegistry) -> None:
        p = PREFIX
        self.model_loaded = Gauge(p + "model_loaded", "1 while the model is loaded", ["model"],
                                  registry=r)  # fmt: skip
        self.model_load_time = Histogram(
            p + "model_load_seconds", "From a model's load decision to its pair's ready report",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.model_evictions = Counter(
            p + "model_evictions", "Models unloaded to make room or after their idle timeout",
            ["model"], registry=r,
        )  # fmt: skip

    def add_model(self, model: str) -> None:
        """Export a model's series at 0 from the first scrape (not loaded yet)."""
        self.model_loaded.labels(model).set(0)
        self.model_evictions.labels(model)

    def for_model(self, model: str) -> Metrics:
        """The view a model's manager and supervisor report through: the same registry
        and series, its `model` label set."""
        view = copy.copy(self)
        view.model = model
        return view

    def _at(self, replica: str) -> tuple[str, ...]:
        """The label values of a replica's series (of this view's model, if any)."""
        return (replica,) if self.model is None else (self.model, replica)

    def add_replica(self, replica: str) -> None:
        """Export every series of a replica at 0 (not up yet): from the first scrape,
        not from its first request."""
        for series in (
            self.prompt_tokens, self.generation_tokens, self.cached_tokens,
            self.evicted_tokens, self.retracted, self.ttft, self.itl, self.e2e,
            self.queue_time, self.running, self.queued, self.token_usage, self.capacity,
            self.replica_up, self.replica_restarts, self.replica_requests,
            self.embedding_requests, self.embedding_tokens,
        ):  # fmt: skip
            series.labels(*self._at(replica))
        self.disk.add_replica(replica)
        for reason in FINISH_REASONS:
            self.requests.labels(reason, *self._at(replica))

    def observe_routing(self, policy: str, reason: str, replica: str, seconds: float) -> None:
        self.routing.labels(policy, reason).inc()
        self.routing_time.observe(seconds)
        self.replica_requests.labels(*self._at(replica)).inc()

    def observe_ready(self, ready: SchedulerReady, replica: str = "r0") -> None:
        """A (re)started scheduler: its counters start from 0, its pool is empty."""
        self._stats.pop(self._at(replica), None)  # its cumulative counters start again from 0
        self._down.discard(self._at(replica))
        self.add_replica(replica)
        self.observe_stats(SchedulerStats(0, 0, 0.0, ready.num_slots, 0, 0), replica)
        self.replica_up.labels(*self._at(replica)).set(1)
        if not self._down:
            for process in ("scheduler", "worker"):
                self.up.labels(process).set(1)

    def observe_death(self, process: str, replica: str = "r0") -> None:
        """A replica's child died or hung: both are restarted, nothing runs there meanwhile."""
        self.restarts.labels(process).inc()
        self.replica_restarts.labels(*self._at(replica)).inc()
        self.replica_up.labels(*self._at(replica)).set(0)
        self._down.add(self._at(replica))
        last = self._stats.get(self._at(replica))
        if last is not None:
            zeroed = SchedulerStats(0, 0, 0.0, last.capacity, last.evicted_tokens,
                                    last.retracted_requests)  # fmt: skip
            self._stats[self._at(replica)] = zeroed
            self._set_gauges(zeroed, replica)
        for child in ("scheduler", "worker"):
            self.up.labels(child).set(0)

    def observe_unloaded(self, replica: str = "r0") -> None:
        """A model's pair stopped for good (unloaded): nothing runs or waits there."""
        self.replica_up.labels(*self._at(replica)).set(0)
        last = self._stats.pop(self._at(replica), None)
        capacity = last.capacity if last is not None else 0
        self._set_gauges(SchedulerStats(0, 0, 0.0, capacity, 0, 0), replica)

    def observe_stats(self, s: SchedulerStats, replica: str = "r0") -> None:
        seen = self._stats.get(self._at(replica))
        evicted = s.evicted_tokens - (seen.evicted_tokens if seen else 0)
        retracted = s.retracted_requests - (seen.retracted_requests if seen else 0)
        self.evicted_tokens.labels(*self._at(replica)).inc(max(0, evicted))
        self.retracted.labels(*self._at(replica)).inc(max(0, retracted))
        runs = s.vision_tower_runs - (seen.vision_tower_runs if seen else 0)
        hits = s.vision_cache_hits - (seen.vision_cache_hits if seen else 0)
        self.tower_runs.labels(*self._at(replica)).inc(max(0, runs))
        self.tower_hits.labels(*self._at(replica)).inc(max(0, hits))
        if s.collective_probes > (seen.collective_probes if seen else 0):
            self.collective.labels(*self._at(replica)).observe(s.collective_seconds)
        self._stats[self._at(replica)] = s
        self._set_gauges(s, replica)

    def observe_disk(self, report: DiskReport, replica: str) -> None:
        self.disk.observe_report(report, replica)

    def _set_gauges(self, s: SchedulerStats, replica: str) -> None:
        self.running.labels(*self._at(replica)).set(s.num_running)
        self.queued.labels(*self._at(replica)).set(s.num_queued)
        self.token_usage.labels(*self._at(replica)).set(s.token_usage)
        self.capacity.labels(*self._at(replica)).set(s.capacity)

    def observe_output(self, out: TokenOut, created: float, replica: str = "r0") -> None:
        now = time.monotonic()
        live = self._live.get(out.rid)
        if live is None:
            live = self._live[out.rid] = _Live(created, now, replica)
            self.ttft.labels(*self._at(replica)).observe(now - created)
            self.queue_time.labels(*self._at(replica)).observe(max(0.0, out.queue_time))
            self.prompt_tokens.labels(*self._at(replica)).inc(out.prompt_tokens)
            self.cached_tokens.labels(*self._at(replica)).inc(out.cached_tokens)
            self.disk.observe_first_output(out, replica)
        elif out.token_ids:
            gap = (now - live.last) / len(out.token_ids)
            itl = self.itl.labels(*self._at(replica))
            for _ in out.token_ids:
                itl.observe(gap)
        self.generation_tokens.labels(*self._at(replica)).inc(len(out.token_ids))
        live.last = now
        if out.finish_reason is not None:
            del self._live[out.rid]
            self.e2e.labels(*self._at(replica)).observe(now - created)
            self.requests.labels(out.finish_reason, *self._at(replica)).inc()

    def observe_embedding(self, tokens: int, replica: str = "r0") -> None:
        self.embedding_requests.labels(*self._at(replica)).inc()
        self.embedding_tokens.labels(*self._at(replica)).inc(tokens)

    def note_finish(self, rid: str, reason: str) -> None:
        """The router ended a request itself (a stop string matched on the text)."""
        live = self._live.get(rid)
        if live is not None:
            live.end_reason = reason

    def forget(self, rid: str) -> None:
        """A request's caller is done with it; one that never finished counts as ended
        by the router: a stop string (`note_finish`) or an abort (client gone).

        Requests aborted before their first output are not seen here and not counted.
        """
        live = self._live.pop(rid, None)
        if live is None:
            return
        if live.end_reason is not None:
            self.e2e.labels(*self._at(live.replica)).observe(time.monotonic() - live.created)
        self.requests.labels(live.end_reason or "abort", *self._at(live.replica)).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


async def track_finish(chunks: AsyncIterator, metrics: Metrics | None, rid: str) -> AsyncIterator:
    """Pass chunks through, telling `metrics` how the router ended the request (a stop
    string) before the request's `forget` counts it."""
    try:
        async for c in chunks:
            if c.finish_reason is not None and metrics is not None:
                metrics.note_finish(rid, c.finish_reason)
            yield c
    finally:
        await chunks.aclose()
