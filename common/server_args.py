"""Server arguments shared by every process, with SGLang's flag names where one exists."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass


@dataclass
class ServerArgs:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.8 if sys.platform == "darwin" else 0.5
    max_running_requests: int = 64
    max_queued_requests: int = 4096
    chunked_prefill_size: int = 2048
    prefill_step_size: int | None = None
    schedule_policy: str = "lpm"
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    disable_cpu_kernels: bool = False
    context_length: int | None = None
    decode_log_interval: int = 40
    log_level: str = "info"
    api_key: str | None = None
    # browsers may call the API from these origins ("*": any, as vLLM, SGLang and mlx-lm)
    allowed_origins: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    max_request_bytes: int = 16 * 1024 * 1024
    zmq_port: int | None = None
    transport: str = "ipc"
    served_model_name: str | None = None
    debug_invariants: bool = False
    seed: int = 0
    trace_dir: str | None = None

    def validate(self) -> None:
        """Raise ValueError with the flag name for a value that cannot work."""
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            raise ValueError("--max-total-tokens must be >= 2")
        if not 0 < self.mem_fraction_static <= 1:
            raise ValueError("--mem-fraction-static must be in (0, 1]")
        if self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be >= 1")
        if self.max_queued_requests < 1:
            raise ValueError("--max-queued-requests must be >= 1")
        if self.chunked_prefill_size < 1:
            raise ValueError("--chunked-prefill-size must be >= 1")
        if self.prefill_step_size is not None and self.prefill_step_size < 1:
            raise ValueError("--prefill-step-size must be >= 1")
        if self.schedule_policy not in ("lpm", "fcfs"):
            raise ValueError("--schedule-policy must be lpm or fcfs")
        if self.transport not in ("ipc", "tcp"):
            raise ValueError("--transport must be ipc or tcp")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    d = ServerArgs(model_path="")
    a = parser.add_argument
    a("--model-path", required=True, help="local model directory or Hugging Face id")
    a("--host", default=d.host, help="HTTP bind address (default 127.0.0.1)")
    a("--port", type=int, default=d.port, help="HTTP port")
    a("--max-total-tokens", type=int, default=None, help="KV pool size in tokens (default: auto)")
    a(
        "--mem-fraction-static",
        type=float,
        default=d.mem_fraction_static,
        help="share of free memory the auto-sized KV pool may take",
    )
    a("--max-running-requests", type=int, default=d.max_running_requests)
    a(
        "--max-queued-requests",
        type=int,
        default=d.max_queued_requests,
        help="requests in flight beyond which new ones get 503",
    )
    a(
        "--chunked-prefill-size",
        type=int,
        default=d.chunked_prefill_size,
        help="most prompt tokens computed in one prefill step",
    )
    a(
        "--prefill-step-size",
        type=int,
        default=None,
        help="worker tokens per prefill forward pass and row (default 256 on CPU, 2048 on Metal)",
    )
    a("--schedule-policy", choices=["lpm", "fcfs"], default=d.schedule_policy)
    a("--disable-radix-cache", action="store_true", help="never reuse a cached prefix")
    a(
        "--disable-overlap-schedule",
        action="store_true",
        help="never let the worker compute a decode step before it is asked for",
    )
    a(
        "--disable-cpu-kernels",
        action="store_true",
        help="on the CPU, keep mlx's own exp and an uncompiled decode step (slower; see docs)",
    )
    a("--context-length", type=int, default=None, help="override the model's context length")
    a("--decode-log-interval", type=int, default=d.decode_log_interval)
    a("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])
    a("--api-key", default=None, help="require 'Authorization: Bearer KEY' on the HTTP API")
    a(
        "--allowed-origins",
        nargs="*",
        default=d.allowed_origins,
        metavar="ORIGIN",
        help="origins whose web pages may call the HTTP API (CORS; default '*', none: off)",
    )
    a("--max-request-bytes", type=int, default=d.max_request_bytes)
    a(
        "--zmq-port",
        type=int,
        default=None,
        help="TCP port of the SDK front door on --host (default: HTTP port + 1)",
    )
    a(
        "--transport",
        choices=["ipc", "tcp"],
        default=d.transport,
        help="how the router, scheduler and worker talk (ipc sockets or tcp on loopback)",
    )
    a("--served-model-name", default=None)
    a("--debug-invariants", action="store_true", help="check KV bookkeeping every step")
    a("--seed", type=int, default=d.seed)
    a(
        "--trace-dir",
        default=None,
        help="append timestamped events of every process there (python -m router.trace_report)",
    )


def args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    names = {f.name for f in dataclasses.fields(ServerArgs)}
    return ServerArgs(**{k: v for k, v in vars(ns).items() if k in names})
