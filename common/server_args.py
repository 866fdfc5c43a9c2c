"""Server arguments shared by every process, with SGLang's flag names where one exists.

Each `ServerArgs` field is declared once, with its default, help text and choices; the
`radix-mlx serve` parser is derived from the fields: flag `--max-total-tokens` for field
`max_total_tokens`, argparse type from the annotation (bool: a switch, list[str]: any
number of values, `X | None`: X). A field with metadata `cli=False` is no flag. Each
field also names the subcommands that take it (`commands`: both `serve` and `replica` by
default), so each subcommand shows and accepts only its own flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import dataclass
from typing import Any

from common.addresses import MAX_PORT, check_port, tcp_address
from common.lora_adapters import LoraSpec, parse_lora_flags
from common.sizes import parse_size

REQUIRED: Any = dataclasses.MISSING
COMMANDS = ("serve", "replica")  # the subcommands whose flags ServerArgs holds
SERVE = ("serve",)  # the router's: HTTP, the SDK front door, replicas and routing
REPLICA = ("replica",)  # a remote replica's: where it listens, whom it admits


def flag(
    default: Any,
    help: str,
    choices: list[str] | None = None,
    commands: tuple[str, ...] = COMMANDS,
    **argparse_kwargs: Any,
):
    """A ServerArgs field: its default (REQUIRED: none), help text, choices, the
    subcommands that take it, and any other argparse keywords (metavar, ...) for its flag."""
    metadata = {"help": help, "choices": choices, "commands": commands, "argparse": argparse_kwargs}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclass
class ServerArgs:
    model_path: str | None = flag(
        None,
        "local mlx-lm model directory or Hugging Face id; `serve` takes several (repeatable: "
        "each is served under its directory's name and loaded on demand)",
        metavar="PATH",
        action="append",
    )
    host: str = flag("127.0.0.1", "HTTP bind address", commands=SERVE)
    port: int = flag(30000, "HTTP port", commands=SERVE)
    max_total_tokens: int | None = flag(
        None,
        "KV pool size in tokens (default: auto, what --max-memory leaves beside the weights "
        "and a prefill pass x --mem-fraction-static)",
    )
    mem_fraction_static: float | None = flag(
        None,
        "share of what --max-memory leaves beside the weights the auto-sized KV pool may take "
        "(default: the device backend's, 0.8 on a GPU (Metal, CUDA), 0.5 on the CPU)",
    )
    max_memory: str | None = flag(
        None,
        "most memory the worker process may use (split among the replicas and ranks on "
        "this machine), as bytes or e.g. 12GiB, 800MB: weights, "
        "KV and state pools, the decode buffer and each step's temporaries all count, and "
        "requests are admitted, chunked or refused to stay under it (default: the device "
        "backend's safe share: on Metal the GPU's recommended working set, on the CPU "
        "MemAvailable at start less 10% (at least 512 MiB), on CUDA the free memory)",
        metavar="SIZE",
    )
    memory_wait_timeout: float = flag(
        30.0,
        "seconds a request that fits --max-memory alone, but not beside the running ones, "
        "may wait in the queue before it gets 503 with Retry-After",
    )
    kv_cache_dtype: str = flag(
        "auto",
        "how the KV pool stores keys and values: auto (the model's dtype), bf16, fp16, or "
        "int8/int4 (mlx-lm's quantized KV cache, groups of 64 along the head dim)",
        choices=["auto", "bf16", "fp16", "int8", "int4"],
    )
    pooling: str | None = flag(
        None,
        "how /v1/embeddings pools a model's last hidden states: last (the last token's, "
        "Qwen3-Embedding's) or mean (default: the model's sentence-transformers pooling "
        "config, else last)",
        choices=["last", "mean"],
    )
    kv_disk_dir: str | None = flag(
        None,
        "directory of the persistent KV tier (off by default): prefixes of finished "
        "requests are written there as blocks and loaded back instead of recomputed, "
        "also after a restart; under DIR/<fingerprint>/ per model and KV layout",
        metavar="DIR",
    )
    kv_disk_budget: str | None = flag(
        None,
        "most bytes the KV tier keeps under --kv-disk-dir, least recently used blocks "
        "evicted first (default: 10% of the free space of that disk, at most 64GiB)",
        metavar="SIZE",
    )
    kv_disk_block_tokens: int = flag(
        256, "tokens per block of the KV tier (the unit written, keyed and loaded)"
    )
    max_running_requests: int = flag(64, "decode batch limit")
    max_queued_requests: int = flag(
        4096, "requests in flight beyond which new ones get 503", commands=SERVE
    )
    chunked_prefill_size: int = flag(2048, "most prompt tokens computed in one prefill step")
    prefill_step_size: int | None = flag(
        None,
        "worker tokens per prefill forward pass and row "
        "(default: the device backend's, 256 on the CPU, 2048 on a GPU)",
    )
    schedule_policy: str = flag(
        "lpm", "lpm: longest cached prefix first, fcfs: arrival order", choices=["lpm", "fcfs"]
    )
    disable_radix_cache: bool = flag(False, "never reuse a cached prefix")
    disable_overlap_schedule: bool = flag(
        False, "never let the worker compute a decode step before it is asked for"
    )
    disable_cpu_kernels: bool = flag(
        False, "on the CPU, keep mlx's own kernels and an uncompiled decode step (slower; see docs)"
    )
    context_length: int | None = flag(None, "override the model's context length")
    tp_size: int = flag(
        1,
        "tensor parallelism: the worker is this many rank processes, each holding a share "
        "of every layer's heads (mx.distributed)",
    )
    pp_size: int = flag(
        1,
        "pipeline parallelism: the worker is this many rank processes, each holding a "
        "contiguous share of the layers (mx.distributed); not together with --tp-size",
    )
    dist_backend: str = flag(
        "ring", "mx.distributed backend of the worker's ranks", choices=["ring", "jaccl", "mpi"]
    )
    dist_hostfile: str | None = flag(
        None,
        "mlx.launch's JSON hostfile of the ranks (default: all ranks on this machine, a "
        "loopback ring); with it, run the command under mlx.launch (see deploy/multi-mac.md)",
    )
    dist_port: int | None = flag(
        None,
        "first TCP port of the loopback ring, one per rank (default: free ports); with "
        "--dist-hostfile, rank 0's ports for the other ranks' descriptors",
    )
    decode_log_interval: int = flag(40, "log decode throughput every this many decode steps")
    log_level: str = flag("info", "log level", choices=["debug", "info", "warning", "error"])
    api_key: str | None = flag(
        None, "require 'Authorization: Bearer KEY' on the HTTP API", commands=SERVE
    )
    # browsers may call the API from these origins ("*": any, as vLLM, SGLang and mlx-lm)
    allowed_origins: list[str] = flag(
        ["*"],
        "origins whose web pages may call the HTTP API (CORS); give none to turn CORS off",
        metavar="ORIGIN",
        commands=SERVE,
    )
    max_request_bytes: int = flag(
        16 * 1024 * 1024, "largest HTTP request body accepted", commands=SERVE
    )
    zmq_port: int | None = flag(
        None,
        "TCP port of the SDK front door on --host (default: HTTP port + 1)",
        commands=SERVE,
    )
    transport: str = flag(
        "ipc",
        "how the router, scheduler and worker talk (ipc sockets or tcp on loopback)",
        choices=["ipc", "tcp"],
        commands=SERVE,
    )
    served_model_name: list[str] | None = flag(
        None,
        "a model id the API accepts (repeatable); the first is the one it reports "
        "(default: the model directory's name)",
        metavar="NAME",
        action="extend",
        commands=SERVE,
    )
    model_alias: list[str] | None = flag(
        None,
        "a glob of other model ids served by this model, e.g. 'claude-haiku-*' (repeatable); "
        "with several models PATTERN=MODEL names the model it serves (default: the first)",
        metavar="PATTERN",
        action="extend",
        commands=SERVE,
    )
    model_dir: str | None = flag(
        None,
        "offer every mlx-lm model directory under DIR (config.json and weights), each under "
        "its directory's name, loaded on demand",
        metavar="DIR",
        commands=SERVE,
    )
    max_loaded_models: int | None = flag(
        None,
        "most models loaded at once; loading one more unloads the least recently used idle "
        "one that is not pinned (default: no limit but --models-memory-budget)",
        commands=SERVE,
    )
    models_memory_budget: str | None = flag(
        None,
        "memory all loaded models share (weights, pools and step temporaries, as each "
        "model's worker measures them), e.g. 24GiB; a model loads with --max-memory what the "
        "others leave, unloading idle ones first (default: no budget)",
        metavar="SIZE",
        commands=SERVE,
    )
    model_idle_timeout: float | None = flag(
        None,
        "seconds an unpinned model may go without requests before it is unloaded (default: "
        "kept until room is needed)",
        commands=SERVE,
    )
    pin_model: list[str] | None = flag(
        None,
        "a model that is loaded at start and never unloaded (repeatable)",
        metavar="NAME",
        action="extend",
        commands=SERVE,
    )
    allow_image_urls: bool = flag(
        False,
        "a vision model fetches http(s) image URLs of requests (else only data: and file: "
        "URLs and base64 sources), within --max-image-bytes and 10 s",
        commands=SERVE,
    )
    max_image_bytes: int = flag(
        8 * 1024 * 1024, "largest image a request may send (its encoded bytes)", commands=SERVE
    )
    max_images_per_request: int = flag(8, "most images one request may send", commands=SERVE)
    strict_max_tokens: bool = flag(
        False,
        "refuse (400) a max_tokens beyond what the context leaves after the prompt, "
        "rather than cut it to fit",
        commands=SERVE,
    )
    chat_template: str | None = flag(
        None,
        "a Jinja chat template file used instead of the tokenizer's (it also decides the "
        "thinking switch and the tool format detected)",
        metavar="FILE",
        commands=SERVE,
    )
    tool_call_parser: str | None = flag(
        None,
        "the tool-call format: one of mlx-lm's tool parsers (json_tools, mistral, "
        "qwen3_coder, ...) or 'generic' (tools written into the chat by radix-mlx, the "
        "default for templates that name no format; see the README) instead of the one "
        "detected from the chat template",
        metavar="NAME",
        commands=SERVE,
    )
    cache_salt_header: str | None = flag(
        None,
        "an HTTP header a gateway sets to the tenant's cache salt; when a request has it, it "
        "overrides the body's cache_salt (only requests with the same salt share cached "
        "prefixes; an empty value is the shared cache)",
        metavar="NAME",
        commands=SERVE,
    )
    responses_store_size: int = flag(
        1024,
        "Responses API: how many responses are kept for previous_response_id and GET "
        "/v1/responses/{id} (least recently used first out; 0: none)",
        commands=SERVE,
    )
    lora: list[str] | None = flag(
        None,
        "serve the LoRA adapter at PATH (what mlx_lm.lora writes) as model NAME, or "
        "BASE:NAME; requests of different adapters and of the base share batches "
        "(repeatable). With several models, BASE:NAME=PATH gives it to model BASE, NAME=PATH "
        "to the one model it fits",
        metavar="[BASE:]NAME=PATH",
        action="extend",
    )
    max_loras_per_batch: int = flag(
        4, "most distinct LoRA adapters in one prefill or decode batch (with --lora)"
    )
    watchdog_timeout: float = flag(
        300.0, "seconds a worker step may take before the worker counts as hung and is restarted"
    )
    graceful_shutdown_timeout: float = flag(
        30.0, "seconds SIGTERM waits for in-flight requests before stopping (a second stops now)"
    )
    max_restarts: int = flag(
        5, "restarts of a dead or hung worker/scheduler allowed within 10 minutes, then exit 1"
    )
    dp_size: int = flag(
        1,
        "data-parallel replicas: scheduler+worker pairs, each with its share of the pool budget",
        commands=SERVE,
    )
    routing_policy: str = flag(
        "cache_aware",
        "which replica a request goes to: longest cached prefix while load is balanced, "
        "the next in turn, or the fewest in flight",
        choices=["cache_aware", "round_robin", "least_load"],
        commands=SERVE,
    )
    cache_threshold: float = flag(
        0.5,
        "cache_aware: share of a prompt a replica must hold cached to get it",
        commands=SERVE,
    )
    balance_abs_threshold: int = flag(
        32,
        "cache_aware: load is imbalanced when replicas differ by more requests than this",
        commands=SERVE,
    )
    balance_rel_threshold: float = flag(
        1.0001,
        "cache_aware: ... and the busiest has more than this times the idlest's",
        commands=SERVE,
    )
    restart_wait_timeout: float = flag(
        30.0,
        "seconds a request sent during a restart waits for it, then gets 503 Retry-After",
        commands=SERVE,
    )
    debug_invariants: bool = flag(False, "check KV bookkeeping every step")
    speculative_algorithm: str = flag(
        "none",
        "speculative decoding: ngram drafts tokens from each request's own prompt and output "
        "(prompt lookup), draft has --speculative-draft-model-path propose them; verified "
        "in one batched step",
        choices=["none", "ngram", "draft"],
    )
    speculative_draft_model_path: str | None = flag(
        None,
        "--speculative-algorithm draft: a small model with the target's tokenizer (local "
        "directory or Hugging Face id) that proposes the drafts",
    )
    speculative_num_draft_tokens: int = flag(
        4, "most draft tokens a request verifies per decode step (with --speculative-algorithm)"
    )
    seed: int = flag(0, "seed of the worker's sampling keys for requests without a seed")
    trace_dir: str | None = flag(
        None,
        "append timestamped events of every process there "
        "(python -m benchmarks.trace_report DIR reads them)",
    )
    replica: list[str] | None = flag(
        None,
        "attach the remote replica `radix-mlx replica` listens at (repeatable)",
        metavar="tcp://HOST:PORT",
        action="extend",
        commands=SERVE,
    )
    listen: str = flag(
        "tcp://127.0.0.1:31000",
        "where it waits for routers (a non-loopback address needs CURVE keys)",
        commands=REPLICA,
    )
    curve_secret_key: str | None = flag(
        None,
        "this process's CURVE secret key file (router.key_secret or replica.key_secret "
        "from `radix-mlx keys`): encrypt and authenticate the router-replica links",
    )
    curve_server_key: str | None = flag(
        None,
        "the replicas' CURVE public key file (replica.key)",
        commands=SERVE,
    )
    curve_authorized_keys: str | None = flag(
        None,
        "directory of the routers' CURVE public keys (*.key) it admits",
        commands=REPLICA,
    )

    def __post_init__(self) -> None:
        # every --model-path given, in order (`model_path` is the first). Not a field: a
        # child's arguments (dataclasses.replace) name the one model it loads.
        self.model_paths = [self.model_path] if self.model_path is not None else []

    def validate(self) -> None:
        """Raise ValueError with the flag name for a value that cannot work."""
        self._validate_models()
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices and not (value is None and f.default is None):
                raise ValueError(f"{flag_name(f)} must be one of {', '.join(choices)}")
        self._validate_ports()
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            raise ValueError("--max-total-tokens must be >= 2")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise ValueError("--mem-fraction-static must be in (0, 1]")
        if self.max_memory is not None:
            try:
                size = parse_size(self.max_memory)
            except ValueError as exc:
                raise ValueError(f"--max-memory: {exc}") from None
            if size < 1 << 20:
                raise ValueError(f"--max-memory {self.max_memory}: at least 1MiB")
        if self.kv_disk_budget is not None:
            try:
                parse_size(self.kv_disk_budget)
            except ValueError as exc:
                raise ValueError(f"--kv-disk-budget: {exc}") from None
        if self.kv_disk_block_tokens < 1:
            raise ValueError("--kv-disk-block-tokens must be >= 1")
        if self.memory_wait_timeout < 0:
            raise ValueError("--memory-wait-timeout must be >= 0")
        if self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be >= 1")
        if not 1 <= self.speculative_num_draft_tokens <= 16:
            raise ValueError("--speculative-num-draft-tokens must be in [1, 16]")
        if (self.speculative_algorithm == "draft") != bool(self.speculative_draft_model_path):
            raise ValueError(
                "--speculative-algorithm draft and --speculative-draft-model-path go together"
            )
        if self.served_model_name is not None and not all(self.served_model_name or [""]):
            raise ValueError("--served-model-name needs a non-empty name")
        if self.max_loras_per_batch < 1:
            raise ValueError("--max-loras-per-batch must be >= 1")
        if self.lora and self.speculative_algorithm != "none":
            raise ValueError(
                "--lora with --speculative-algorithm is not supported yet: the verify "
                "step and the draft model do not apply adapters"
            )
        if self.lora and self.group_size > 1:
            raise ValueError("--lora with --tp-size/--pp-size is not supported yet")
        parse_lora_flags(self.lora, self.served_model_names)
        if self.max_queued_requests < 1:
            raise ValueError("--max-queued-requests must be >= 1")
        if self.chunked_prefill_size < 1:
            raise ValueError("--chunked-prefill-size must be >= 1")
        if self.prefill_step_size is not None and self.prefill_step_size < 1:
            raise ValueError("--prefill-step-size must be >= 1")
        if self.watchdog_timeout <= 0:
            raise ValueError("--watchdog-timeout must be > 0")
        if self.graceful_shutdown_timeout < 0:
            raise ValueError("--graceful-shutdown-timeout must be >= 0")
        if self.responses_store_size < 0:
            raise ValueError("--responses-store-size must be >= 0")
        if self.max_restarts < 0:
            raise ValueError("--max-restarts must be >= 0")
        if self.dp_size < 0 or (self.dp_size == 0 and not self.replica):
            raise ValueError("--dp-size must be >= 1, or 0 with --replica")
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError("--cache-threshold must be in [0, 1]")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError("--balance-abs-threshold must be >= 0, --balance-rel-threshold >= 1")
        if self.replica and bool(self.curve_secret_key) != bool(self.curve_server_key):
            raise ValueError("--curve-secret-key and --curve-server-key go together")
        if self.restart_wait_timeout < 0:
            raise ValueError("--restart-wait-timeout must be >= 0")
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError("--tp-size and --pp-size must be >= 1")
        if self.tp_size > 1 and self.pp_size > 1:
            raise ValueError(
                "--tp-size and --pp-size cannot both be above 1: a worker group is either "
                "tensor- or pipeline-parallel"
            )
        if self.dist_backend != "ring" and not self.dist_hostfile:
            raise ValueError(
                f"--dist-backend {self.dist_backend} needs --dist-hostfile (run under "
                "mlx.launch); ranks on this machine use the ring on loopback"
            )
        if self.group_size > 1 and self.dp_size > 1:
            raise ValueError("--dp-size above 1 with --tp-size/--pp-size is not supported")

    def _validate_models(self) -> None:
        if self.model_path is None and not self.model_dir:
            raise ValueError("give --model-path (or, to serve several models, --model-dir)")
        if self.max_loaded_models is not None and self.max_loaded_models < 1:
            raise ValueError("--max-loaded-models must be >= 1")
        if self.model_idle_timeout is not None and self.model_idle_timeout <= 0:
            raise ValueError("--model-idle-timeout must be > 0")
        if self.models_memory_budget is not None:
            try:
                parse_size(self.models_memory_budget)
            except ValueError as exc:
                raise ValueError(f"--models-memory-budget: {exc}") from None
        if self.several_models and (self.replica or self.group_size > 1 or self.dp_size != 1):
            raise ValueError(
                "several models (--model-dir, a repeated --model-path or the --*-model* flags) "
                "run one local scheduler+worker pair each: not with --replica, --dp-size, "
                "--tp-size or --pp-size"
            )
        if not self.several_models:  # with several, the registry matches each to its base
            for spec in self.loras:
                if spec.base and spec.base not in (*self.served_model_names, self.model_path):
                    raise ValueError(
                        f"{spec.flag}: no model {spec.base!r}; serving {self.model_name!r}"
                    )

    @property
    def several_models(self) -> bool:
        """Served as a set of models loaded on demand (router.serving.model_pool) rather
        than the one model of --model-path, started with the server."""
        return (
            len(self.model_paths) > 1
            or self.model_dir is not None
            or self.max_loaded_models is not None
            or self.models_memory_budget is not None
            or self.model_idle_timeout is not None
            or bool(self.pin_model)
        )

    def _validate_ports(self) -> None:
        """Every port a flag names is 1..65535 (a larger one would be taken modulo 65536
        by the bind, and the log would name a port nothing listens on)."""
        check_port(self.port, "--port")
        if self.zmq_port is None:
            if self.port == MAX_PORT:
                raise ValueError(
                    f"--port {MAX_PORT} leaves no port + 1 for the SDK: give --zmq-port"
                )
        else:
            check_port(self.zmq_port, "--zmq-port")
            if self.zmq_port == self.port:
                raise ValueError(f"--zmq-port {self.zmq_port} is --port's too: give another")
        if self.dist_port is not None:
            check_port(self.dist_port, "--dist-port")
            check_port(
                self.dist_port + self.group_size - 1, f"--dist-port (rank {self.group_size - 1})"
            )
        tcp_address(self.listen, "--listen")
        for address in self.replica or []:
            tcp_address(address, "--replica")

    @property
    def max_memory_bytes(self) -> int | None:
        """--max-memory in bytes (None: the backend's default)."""
        return None if self.max_memory is None else parse_size(self.max_memory)

    @property
    def group_size(self) -> int:
        """The worker's rank processes (1: one process, no mx.distributed group)."""
        return self.tp_size * self.pp_size

    @property
    def served_model_names(self) -> list[str]:
        """The model ids the API accepts, the reported one first: the given names, else
        the model directory's (or Hugging Face id's) last part, which clients that parse
        `provider/model` strings take as it is."""
        if self.served_model_name:
            return list(self.served_model_name)
        return [default_model_name(self.model_path or "")]

    @property
    def loras(self) -> list[LoraSpec]:
        """The --lora adapters in order: adapter id i + 1 is loras[i] (0: the base)."""
        return parse_lora_flags(self.lora, self.served_model_names)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


def default_model_name(path: str) -> str:
    """The id a model is served under: its directory's (or Hugging Face id's) last part."""
    return os.path.basename(path.rstrip("/")) or path


def flag_name(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def cli_fields(command: str | None = None) -> list[dataclasses.Field]:
    """The ServerArgs fields that are flags: of `command` (serve, replica), or of any."""
    return [
        f
        for f in dataclasses.fields(ServerArgs)
        if f.metadata.get("cli", True) and (command is None or command in f.metadata["commands"])
    ]


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _argparse_kwargs(f: dataclasses.Field, annotation: Any) -> dict[str, Any]:
    default = _default(f)
    kw: dict[str, Any] = {"help": f.metadata["help"], **f.metadata["argparse"]}
    if default is dataclasses.MISSING:
        kw["required"] = True
    else:
        kw["default"] = default
    if f.metadata["choices"]:
        kw["choices"] = f.metadata["choices"]
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) and len(args) == 1:
        annotation = args[0]  # X | None: an X, or the default None
    if annotation is bool:
        if default is not False:
            raise TypeError(f"bool field {f.name} must default to False (a store_true switch)")
        kw["action"] = "store_true"
    elif typing.get_origin(annotation) is list:
        kw["nargs"] = "*"
        kw["type"] = typing.get_args(annotation)[0]
    elif annotation in (int, float):
        kw["type"] = annotation
    elif annotation is not str:
        raise TypeError(f"no argparse type for field {f.name}: {annotation}")
    if not any(default is d for d in (None, False, dataclasses.MISSING)):
        shown = " ".join(default) if isinstance(default, list) else default
        kw["help"] += f" (default: {shown})"
    kw["help"] = kw["help"].replace("%", "%%")  # argparse formats help with %
    return kw


def add_command_args(parser: argparse.ArgumentParser, command: str) -> None:
    """`command`'s flags (serve, replica): only its own, so another's is an error."""
    hints = typing.get_type_hints(ServerArgs)
    for f in cli_fields(command):
        parser.add_argument(flag_name(f), **_argparse_kwargs(f, hints[f.name]))


def args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    names = {f.name for f in dataclasses.fields(ServerArgs)}
    values = {k: v for k, v in vars(ns).items() if k in names}
    paths = values.get("model_path") or []  # --model-path is repeatable: a list
    values["model_path"] = paths[0] if paths else None
    args = ServerArgs(**values)
    args.model_paths = list(paths)
    return args
