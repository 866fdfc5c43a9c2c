"""Loading and unloading one model's LoRA adapters while it serves (/admin/loras/load and
/unload): checked against the model's files here (one line why not), then loaded by its
worker (common.messages.LoraUpdate), after which requests naming it run it.

Ids are never given twice in a pair's life (the --lora flags' are 1..n, then the next
ones), so a prefix cached under an unloaded adapter's radix namespace can never answer
a later adapter, even one loaded under the same name. An unload takes the name away at
once (new requests get 404) and ends when the scheduler has finished the adapter's
requests already admitted: never under them.

A replica that restarts comes back with its --lora adapters only: the run-time ones are
sent to it again, under their ids, as soon as it reports ready (their requests meanwhile
get a 404 from its scheduler).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os

from common.lora_adapters import adapter_problem
from common.server_args import ServerArgs
from router.api.model_names import ModelNames
from router.replicas.manager import RouterManager
from router.request_error import RequestError

logger = logging.getLogger("router")


class LoraControl:
    def __init__(self, manager: RouterManager, names: ModelNames, args: ServerArgs):
        self.manager, self.names, self.args = manager, names, args
        self.ids = itertools.count(max(names.loras.values(), default=0) + 1)
        self.loaded: dict[str, tuple[int, str]] = {}  # run-time adapters: name -> (id, path)
        self.tasks: set[asyncio.Task] = set()
        manager.ready_hooks.append(self._replay)

    def _replay(self, replica) -> None:
        """A (re)started replica: the adapters loaded at run time, again."""
        for name, (lora, path) in self.loaded.items():
            task = asyncio.create_task(self._reload(replica, lora, name, path))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _reload(self, replica, lora: int, name: str, path: str) -> None:
        try:
            await self.manager.update_replica_lora(replica, lora, name, path)
            logger.info("LoRA adapter %s loaded again on %s", name, self.names.reported)
        except RequestError as exc:
            logger.error("LoRA adapter %s: not loaded again: %s", name, exc.message)

    def _refuse_here(self) -> None:
        """Where adapters cannot load at run time: 400 naming the flag."""
        args = self.args
        # (with --kv-disk-dir they do: the scheduler keys their blocks by their files)
        flags = [
            ("--speculative-algorithm", args.speculative_algorithm != "none"),
            ("--tp-size/--pp-size", args.group_size > 1),
            ("--replica", bool(args.replica)),
        ]
        for flag, on in flags:
            if on:
                raise RequestError(f"LoRA adapters cannot load at run time with {flag}")

    async def load(self, name: str, path: str) -> None:
        """Serve the adapter at `path` as `name` (400: taken, or not an adapter of it)."""
        self._refuse_here()
        names = self.names
        if name in names.loras or name in (*names.served, names.model_path) or ":" in name:
            raise RequestError(f"lora_name {name!r} is taken or has a ':'", param="lora_name")
        problem = adapter_problem(self.args.model_path, path)
        if problem:
            raise RequestError(
                f"lora_path {path}: cannot serve this adapter on model "
                f"{self.names.reported!r}: {problem}", param="lora_path",
            )  # fmt: skip
        lora = next(self.ids)
        await self.manager.update_lora(lora, name, os.path.abspath(path))
        self.names.loras[name] = lora
        self.loaded[name] = (lora, os.path.abspath(path))
        logger.info("LoRA adapter %s loaded (id %d) on %s: %s", name, lora,
                    self.names.reported, path)  # fmt: skip

    async def unload(self, name: str) -> None:
        """Stop serving adapter `name` once its requests in flight are done (404: none)."""
        lora = self.names.loras.pop(name, None)  # new requests naming it: 404 from now on
        self.loaded.pop(name, None)
        if lora is None:
            raise RequestError(f"no LoRA adapter {name!r} is loaded", "model_not_found", 404,
                               param="lora_name")  # fmt: skip
        await self.manager.update_lora(lora, name)
        logger.info("LoRA adapter %s unloaded from %s", name, self.names.reported)
