"""The disk tier's Prometheus series (--kv-disk-dir), fed by the worker's DiskReport
(relayed by the scheduler) and by each request's first output (its cache hits by tier)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.messages import DiskReport, TokenOut

PREFIX = "radix_mlx_"
DISK_BUCKETS = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
DISK_METRICS = {
    "kv_disk_bytes": "gauge",
    "kv_disk_blocks": "gauge",
    "cache_hit_tokens": "counter",
    "kv_disk_read_seconds": "histogram",
    "kv_disk_write_seconds": "histogram",
    "kv_disk_errors": "counter",
}
ERROR_REASONS = ("missing", "truncated", "checksum", "foreign", "write")


class DiskMetrics:
    def __init__(self, r: CollectorRegistry):
        label = ["replica"]
        self.bytes = Gauge(PREFIX + "kv_disk_bytes", "Bytes the KV disk tier holds", label,
                           registry=r)  # fmt: skip
        self.blocks = Gauge(PREFIX + "kv_disk_blocks", "Blocks the KV disk tier holds", label,
                            registry=r)  # fmt: skip
        self.hits = Counter(
            PREFIX + "cache_hit_tokens", "Prompt tokens served from a cache tier (pool: the "
            "KV pool, disk: loaded from --kv-disk-dir)", ["tier", "replica"], registry=r,
        )  # fmt: skip
        self.reads = Histogram(
            PREFIX + "kv_disk_read_seconds", "Seconds to load one block into the pool", label,
            buckets=DISK_BUCKETS, registry=r,
        )  # fmt: skip
        self.writes = Histogram(
            PREFIX + "kv_disk_write_seconds", "Seconds to write one block file", label,
            buckets=DISK_BUCKETS, registry=r,
        )  # fmt: skip
        self.errors = Counter(
            PREFIX + "kv_disk_errors", "Blocks the tier could not read (missing, truncated, "
            "checksum, foreign: recomputed) or write", ["reason", "replica"], registry=r,
        )  # fmt: skip

    def add_replica(self, replica: str) -> None:
        for series in (self.bytes, self.blocks, self.reads, self.writes):
            series.labels(replica)
        for tier in ("pool", "disk"):
            self.hits.labels(tier, replica)
        for reason in ERROR_REASONS:
            self.errors.labels(reason, replica)

    def observe_report(self, report: DiskReport, replica: str) -> None:
        self.bytes.labels(replica).set(report.bytes)
        self.blocks.labels(replica).set(report.blocks)
        for reason, n in report.errors.items():
            self.errors.labels(reason, replica).inc(n)
        for seconds in report.read_seconds:
            self.reads.labels(replica).observe(seconds)
        for seconds in report.write_seconds:
            self.writes.labels(replica).observe(seconds)

    def observe_first_output(self, out: TokenOut, replica: str) -> None:
        disk = min(out.disk_cached_tokens, out.cached_tokens)
        self.hits.labels("pool", replica).inc(out.cached_tokens - disk)
        self.hits.labels("disk", replica).inc(disk)
