"""One model of a server with several (router.serving.model_pool): its scheduler+worker
pair, supervised and restarted as a single model's (router.serving.supervisor), its
RouterManager and the API context its requests run over.

Each load is a new `LoadedModel` with its own runtime subdirectory, sockets and ZMQ
context, so a new version of a model (hot swap) can start beside the old one, which
finishes its requests and then stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time

import zmq.asyncio

from common.child_process import StopFlag
from common.ipc import Endpoints
from common.server_args import ServerArgs
from common.sizes import format_size
from common.trace import Trace
from router.api.api_context import ApiContext
from router.api.chat_overrides import apply_chat_overrides
from router.api.lora_control import LoraControl
from router.metrics import Metrics
from router.replicas.manager import RouterManager
from router.replicas.replica_set import Replica, ReplicaLink, ReplicaSet
from router.replicas.routing import make_policy
from router.serving.model_files import load_tokenizer
from router.serving.model_registry import ModelEntry
from router.serving.supervisor import Children, Supervision, Supervisor

logger = logging.getLogger("router")
DRAIN_POLL = 0.05  # seconds between checks for the last request of a model being unloaded


class LoadedModel:
    def __init__(self, entry: ModelEntry, args: ServerArgs, metrics: Metrics,
                 runtime_dir: str, stopping: StopFlag, template: str | None):  # fmt: skip
        """`args`: the server's, with the --max-memory this model's worker gets;
        `runtime_dir`: a new directory for its sockets (short: an ipc path has ~100
        bytes)."""
        self.entry, self.metrics, self.template = entry, metrics.for_model(entry.name), template
        # its own adapters only, in its entry's order (their ids: self.names)
        self.args = dataclasses.replace(args, model_path=entry.path, lora=entry.lora_flags())
        self.names = entry.names()
        os.mkdir(runtime_dir)
        endpoints = Endpoints.ipc(runtime_dir) if args.transport == "ipc" else Endpoints.tcp()
        self.children = Children(self.args, endpoints, f"-{entry.name}", stopping, standbys=False)
        self.ctx = zmq.asyncio.Context()
        self.replica = Replica("r0", endpoints.scheduler_in, ReplicaLink.local(self.ctx, endpoints))
        self.manager: RouterManager | None = None
        self.api: ApiContext | None = None
        self.loras: LoraControl | None = None  # its adapters at run time, once it serves
        self.tasks: list[asyncio.Task] = []
        self.last_used = time.monotonic()
        self.gave_up = asyncio.Event()  # its pair crash-looped (--max-restarts)

    @property
    def busy(self) -> bool:
        """Requests of it are in flight (a request between its model's choice and its
        generation counts through `last_used`: router.serving.model_pool)."""
        return self.manager is not None and bool(self.manager.pending)

    @property
    def footprint(self) -> int:
        """Bytes of the models' budget it takes: the budget its worker measured and keeps
        to (weights, pools, step temporaries); 0 before it reported."""
        ready = self.replica.ready
        return ready.memory_budget if ready is not None else 0

    async def start(self) -> tuple[str, str] | None:
        """Spawn the pair and wait until it serves: None, else (process, why not)."""
        tokenizer = await asyncio.to_thread(load_tokenizer, self.entry.path)
        apply_chat_overrides(tokenizer, self.args, self.template)
        args = self.args
        policy = make_policy(args.routing_policy, args.cache_threshold,
                             args.balance_abs_threshold, args.balance_rel_threshold)  # fmt: skip
        self.manager = manager = RouterManager(
            ReplicaSet([self.replica]), tokenizer, self.metrics, args.max_queued_requests,
            Trace(args.trace_dir, "router"), policy, self.ctx, args.restart_wait_timeout,
        )  # fmt: skip
        supervision = Supervision(
            [Supervisor(self.children, self.replica, manager, self.metrics, args.max_restarts)]
        )
        await asyncio.to_thread(self.children.start)
        self.tasks.append(asyncio.create_task(manager.receive_loop()))
        failure = await supervision.wait_ready()
        if failure is not None:
            await self.stop()
            return failure
        manager.serving()
        self.tasks.append(asyncio.create_task(self._watch(supervision)))
        self.api = ApiContext(manager, tokenizer, args, self.metrics, self.names)
        self.loras = LoraControl(manager, self.names, args)
        return None

    async def _watch(self, supervision: Supervision) -> None:
        line = await supervision.watch()
        if line:  # gave up after --max-restarts: requests get a 503 naming why, until
            logger.error("model %s: %s", self.entry.name, line)  # the pool takes it out
            self.gave_up.set()

    def describe_memory(self) -> str:
        """What its worker measured, for the log."""
        ready = self.replica.ready
        if ready is None or not ready.memory_budget:
            return "its memory was not reported"
        held, budget = format_size(ready.memory_fixed), format_size(ready.memory_budget)
        return f"holds {held} of its {budget} (measured), KV pool {ready.num_slots} tokens"

    async def drain(self, timeout: float) -> int:
        """Wait until its requests in flight are done (at most `timeout` s); how many
        still run."""
        deadline = time.monotonic() + timeout
        while self.busy and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL)
        return len(self.manager.pending) if self.manager is not None else 0

    async def stop(self, reason: str = "the model was unloaded") -> None:
        """Stop the pair; requests still in flight (none after a drain) get a 503."""
        if self.manager is not None:
            self.manager.stopped(reason)
            self.manager.fail_all(reason)
        for task in self.tasks:
            task.cancel()
        await asyncio.to_thread(self.children.stop)
        if self.manager is not None:
            self.manager.close()
        else:
            self.replica.link.close()
            self.ctx.destroy(linger=0)
