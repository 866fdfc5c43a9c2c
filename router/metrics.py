"""Prometheus metrics, all exposed by the router on the HTTP port.

The scheduler reports its gauges and cumulative counters in SchedulerStats messages;
the router measures latencies itself. One registry per server, so tests can run several.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from common.messages import SchedulerStats, TokenOut

# From a fast Mac (ms) to a slow CPU under load (minutes).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5)


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        p = "radix_mlx_"
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter(
            p + "cached_tokens", "Prompt tokens from the prefix cache", registry=r
        )
        self.requests = Counter(p + "requests", "Finished requests", ["finish_reason"], registry=r)
        self.evicted_tokens = Counter(
            p + "evicted_tokens", "Tokens evicted from the cache", registry=r
        )
        self.retracted = Counter(
            p + "retracted_requests", "Requests retracted to the queue", registry=r
        )
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "Time to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            p + "inter_token_latency_seconds",
            "Time between output tokens",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds",
            "Request latency",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            p + "queue_time_seconds",
            "Time before the prefill starts",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge(p + "num_running_requests", "Running requests", registry=r)
        self.queued = Gauge(p + "num_queued_requests", "Waiting requests", registry=r)
        self.token_usage = Gauge(
            p + "token_usage", "KV pool share held by running requests", registry=r
        )
        self.capacity = Gauge(p + "kv_pool_capacity_tokens", "KV pool size", registry=r)
        self._evicted_seen = 0
        self._retracted_seen = 0
        self._last_token_at: dict[str, float] = {}

    def observe_stats(self, s: SchedulerStats) -> None:
        self.running.set(s.num_running)
        self.queued.set(s.num_queued)
        self.token_usage.set(s.token_usage)
        self.capacity.set(s.capacity)
        self.evicted_tokens.inc(max(0, s.evicted_tokens - self._evicted_seen))
        self.retracted.inc(max(0, s.retracted_requests - self._retracted_seen))
        self._evicted_seen = s.evicted_tokens
        self._retracted_seen = s.retracted_requests

    def observe_output(self, out: TokenOut, created: float) -> None:
        now = time.monotonic()
        last = self._last_token_at.get(out.rid)
        if last is None:
            self.ttft.observe(now - created)
            self.prompt_tokens.inc(out.prompt_tokens)
            self.cached_tokens.inc(out.cached_tokens)
        elif out.token_ids:
            gap = (now - last) / len(out.token_ids)
            for _ in out.token_ids:
                self.itl.observe(gap)
        self.generation_tokens.inc(len(out.token_ids))
        self._last_token_at[out.rid] = now
        if out.finish_reason is not None:
            self._last_token_at.pop(out.rid, None)
            self.e2e.observe(now - created)
            self.requests.labels(out.finish_reason).inc()

    def forget(self, rid: str) -> None:
        """Drop per-request state of a request that ended without a finishing output."""
        self._last_token_at.pop(rid, None)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
