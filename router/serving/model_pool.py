"""Which of a server's models are loaded (router.serving.model_registry lists them all):
a request's model is loaded on demand, and what stays is decided by --max-loaded-models,
--models-memory-budget, --model-idle-timeout and --pin-model.

- **Load.** A request naming a model that is not loaded starts its pair (one load at a
  time, in order) and waits for it up to --restart-wait-timeout, then gets a 503 with
  Retry-After (the load goes on). A model whose weight files alone exceed the budget (or
  its share, budget / --max-loaded-models) is refused with the sizes (400).
- **Room.** Before a load, the least recently used model that is not pinned and idle is
  unloaded while the count or the memory would not fit. Idle: no request in flight, and
  none chose it within GRACE seconds (a request between its model's choice and its
  generation, tokenizing, is not in the manager yet). A busy model is waited for, up to
  --restart-wait-timeout, never unloaded under its requests.
- **Memory.** A model's worker gets --max-memory: what the budget leaves beside the
  loaded models' own budgets (as each worker measured and reported them), at most the
  budget / --max-loaded-models; its KV pool is sized from that, and the log says so.
- **Crash loop.** A model whose pair is given up (--max-restarts) is unloaded; the next
  request for it loads it afresh.
- **Hot swap.** `load(name, reload=True)` (or a new path under the name) starts a new
  pair beside the old one, with the old one's share of the budget and slot (both run
  for a while); once it serves it takes the new requests and the old one stops after
  its requests are done.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import time

from fastapi.responses import JSONResponse

from common.child_process import StopFlag
from common.lora_adapters import LoraSpec
from common.server_args import ServerArgs
from common.sizes import format_size
from router.api.api_context import ApiContext
from router.api.served_models import model_card
from router.metrics import Metrics
from router.request_error import RequestError, unavailable
from router.serving.loaded_model import LoadedModel
from router.serving.model_files import ModelNotFound, resolve_model_path
from router.serving.model_registry import ModelEntry, ModelRegistry
from router.serving.model_room import GRACE, ModelRoom

logger = logging.getLogger("router")
KEEP_INTERVAL = 0.25  # seconds between checks for idle models
ROOM_POLL = 0.05  # seconds between checks for a busy model to become idle
RETRY_AFTER = 5  # seconds, the Retry-After of a 503 while a model loads
RETIRE_TIMEOUT = 3600.0  # seconds an old version's requests get to finish after a swap


class ModelPool:
    def __init__(self, registry: ModelRegistry, args: ServerArgs, metrics: Metrics,
                 runtime_dir: str, stopping: StopFlag, template: str | None):  # fmt: skip
        self.registry, self.args, self.metrics = registry, args, metrics
        self.runtime_dir, self.stopping, self.template = runtime_dir, stopping, template
        self.loaded: dict[str, LoadedModel] = {}
        self.loading: dict[str, asyncio.Task] = {}
        # taken out but not stopped yet: swapped-out versions, unloads finishing requests
        self.retired: set[LoadedModel] = set()
        self.lock = asyncio.Lock()  # one load or unload decision at a time
        self.loads = itertools.count()  # numbers each load's runtime subdirectory
        self.room = ModelRoom(args)
        self.pinned = self.room.pinned
        self.state, self.reason = "serving", ""
        for entry in registry:
            metrics.add_model(entry.name)

    # ------------------------------------------------------------ the API's side

    async def context(self, name: str | None) -> ApiContext:
        """The context of the model a request names, loaded if it was not: 404 for a
        name no model answers to, 503 while the server drains or the load takes longer
        than --restart-wait-timeout."""
        entry = self.registry.find(name)
        self._check_serving()
        model = await self._loaded(entry, self.args.restart_wait_timeout)
        model.last_used = time.monotonic()
        model.manager.check_ready()
        return model.api

    def cards(self) -> list[dict]:
        """Each model, then its adapters."""
        ids = [[e.name, *(spec.name for spec in e.loras)] for e in self.registry]
        return [self.card(model_id) for names in ids for model_id in names]

    def card(self, model_id: str) -> dict:
        """A model's card, or an adapter's, which names its base as its `parent`."""
        entry = self.registry.find(model_id)
        model = self.loaded.get(entry.name)
        max_len = model.manager.max_model_len if model is not None else 0
        extra = {"parent": entry.name} if entry.adapts(model_id) else {}
        return model_card(model_id, max_len, loaded=model is not None, **extra)

    def health(self) -> JSONResponse:
        """200 while serving (a model that is not loaded is loaded when asked for)."""
        models = [{"id": e.name, "loaded": e.name in self.loaded} for e in self.registry]
        status = "ok" if self.healthy else self.reason or self.state
        return JSONResponse({"status": status, "models": models}, 200 if self.healthy else 503)

    @property
    def healthy(self) -> bool:
        return self.state == "serving"

    def _check_serving(self) -> None:
        if self.state != "serving":
            raise unavailable(f"server is {self.reason or self.state}")

    # ------------------------------------------------------------ admin

    async def load(self, name: str, path: str | None = None, reload: bool = False) -> dict:
        """Load `name` (its card once it serves); with `path`, serve that directory under
        it from now on; `reload` (implied by a new path of a loaded model) swaps a loaded
        model for a new pair without failing a request."""
        self._check_serving()
        entry = self.registry.find(name) if path is None else self._entry_at(name, path)
        old = self.loaded.get(entry.name)
        if old is not None and (reload or old.entry.path != entry.path):
            await self._guarded_load(entry, swap=True)
        else:
            await self._loaded(entry, None)
        return self.card(entry.name)

    def _entry_at(self, name: str, path: str) -> ModelEntry:
        try:
            local = resolve_model_path(path)
        except ModelNotFound as exc:
            raise RequestError(str(exc).replace("--model-path ", "path "), param="path") from None
        entry = self.registry.entries.get(name)
        if entry is None:
            entry = ModelEntry(name, local, path)
            self.registry.add(entry)
            self.metrics.add_model(name)
            return entry
        return dataclasses.replace(entry, path=local)  # its names stay as configured

    async def unload(self, name: str) -> dict:
        """Unload a model once its requests in flight are done (its card)."""
        entry = self.registry.find(name)
        if entry.name in self.pinned:
            raise RequestError(f"model {entry.name!r} is pinned (--pin-model)", param="model")
        async with self.lock:
            model = self.loaded.get(entry.name)
            if model is not None:
                self._take_out(model, "asked by /admin/models/unload", evicted=False)
        if model is not None:  # its requests may take long: loads go on meanwhile
            await self._stop(model)
        return self.card(entry.name)

    async def load_lora(self, name: str, path: str) -> dict:
        """Serve the adapter at `path` as `name` (`BASE:NAME`, or `NAME` for the one model
        it applies to): now if its model is loaded, else whenever it loads. Its card."""
        self._check_serving()
        base, _, lora = name.rpartition(":")
        if base:
            self.registry.find(base)  # 404 naming it
        spec = LoraSpec(lora, os.path.abspath(path), base)
        async with self.lock:  # no load of its model starts meanwhile without it
            try:
                entry = self.registry.base_of(spec)
            except ValueError as exc:
                raise RequestError(str(exc), param="lora_path") from None
            model = self.loaded.get(entry.name)
            if model is not None and model.loras is not None:
                await model.loras.load(lora, spec.path)
            entry.loras.append(spec)
        return self.card(lora)

    async def unload_lora(self, name: str) -> dict:
        """Stop serving an adapter (once its requests in flight are done); its card."""
        entry = self.registry.find(name)
        if not entry.adapts(name):
            raise RequestError(f"no LoRA adapter {name!r} is loaded", "model_not_found", 404,
                               param="lora_name")  # fmt: skip
        lora = name.rpartition(":")[2]
        card = self.card(name)
        async with self.lock:  # a load under way of its model ends first (then unloads it)
            entry.loras = [spec for spec in entry.loras if spec.name != lora]
            model = self.loaded.get(entry.name)
        if model is not None and model.loras is not None:  # its requests may take long
            await model.loras.unload(lora)
        return {**card, "loaded": False}

    # ------------------------------------------------------------ loading

    async def start(self) -> str | None:
        """Load the pinned models (else the first): None, or the line why one failed."""
        for name in self.pinned or [self.registry.first.name]:
            try:
                await self._loaded(self.registry.entries[name], None)
            except RequestError as exc:
                return exc.message
        return None

    async def _loaded(self, entry: ModelEntry, timeout: float | None) -> LoadedModel:
        """The model loaded (by this call, or by the load already under way)."""
        model = self.loaded.get(entry.name)
        if model is not None:
            return model
        task = self.loading.get(entry.name)
        if task is None:
            task = self.loading[entry.name] = asyncio.create_task(self._guarded_load(entry))
            task.add_done_callback(lambda t: self._loaded_done(entry.name, t))
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout)
        except asyncio.TimeoutError:
            raise unavailable(
                f"model {entry.name!r} is loading (longer than --restart-wait-timeout "
                f"{self.args.restart_wait_timeout:g} s); retry later", RETRY_AFTER,
            ) from None  # fmt: skip

    def _loaded_done(self, name: str, task: asyncio.Task) -> None:
        if self.loading.get(name) is task:
            del self.loading[name]
        if not task.cancelled():
            task.exception()  # retrieved: a failure reached whoever waited, or nobody did

    async def _guarded_load(self, entry: ModelEntry, swap: bool = False):
        """Load `entry`, or with `swap` a new pair for it beside the loaded one (which,
        under the lock, is the one loaded now: another swap may have come first)."""
        async with self.lock:
            self._check_serving()
            old = self.loaded.get(entry.name)
            if old is not None and not swap:
                return old
            return await self._load(entry, old)

    async def _load(self, entry: ModelEntry, old: LoadedModel | None) -> LoadedModel:
        started = time.monotonic()
        max_memory = await self._make_room(entry, old)
        args = self.args
        if max_memory is not None:
            args = dataclasses.replace(args, max_memory=str(max_memory))
        path = os.path.join(self.runtime_dir, f"m{next(self.loads)}")
        model = LoadedModel(entry, args, self.metrics, path, self.stopping, self.template)
        try:
            failure = await model.start()
        except asyncio.CancelledError:  # the server stops while the model loads
            await model.stop("the server stopped")
            raise
        if failure is not None:
            raise unavailable(f"model {entry.name!r} failed to load: {failure[1]}")
        model.last_used = time.monotonic()  # its idle time starts now, not at the load's start
        seconds = model.last_used - started
        self.metrics.model_load_time.observe(seconds)
        self.metrics.model_loaded.labels(entry.name).set(1)
        logger.info("model %s loaded in %.2f s: %s", entry.name, seconds, model.describe_memory())
        self.registry.entries[entry.name] = entry
        self.loaded[entry.name] = model
        if old is not None:
            self.retired.add(old)
            asyncio.create_task(self._retire(old))
        return model

    async def _retire(self, old: LoadedModel) -> None:
        """A swapped-out version finishes its requests (and those that chose it just
        before the swap), then stops."""
        await asyncio.sleep(GRACE)
        left = await old.drain(RETIRE_TIMEOUT)
        logger.info("model %s: the old version stopped (%d request(s) left)", old.entry.name, left)
        await old.stop("the model was replaced by a new version")
        self.retired.discard(old)

    # ------------------------------------------------------------ room

    async def _make_room(self, entry: ModelEntry, old: LoadedModel | None) -> int | None:
        """Unload what must go for `entry` to load (beside `old`, in a swap); the
        --max-memory its worker gets (None: no budget)."""
        room = self.room
        room.refuse_too_large(entry)
        deadline = time.monotonic() + self.args.restart_wait_timeout
        while room.needs_room(entry, list(self.loaded.values()), self._models(), old):
            victim = room.victim(list(self.loaded.values()), old)
            if victim is not None:
                await self._unload(victim, f"to make room for {entry.name}")
                continue
            if not room.movable(list(self.loaded.values()), old) or time.monotonic() > deadline:
                held = ", ".join(f"{m.entry.name} ({room.why_kept(m)})"
                                 for m in self.loaded.values()) or "none"  # fmt: skip
                raise unavailable(f"no room to load model {entry.name!r}: loaded {held}",
                                  RETRY_AFTER)  # fmt: skip
            await asyncio.sleep(ROOM_POLL)
        if room.budget is None:
            return None
        given = min(room.free(self._models(), old), room.share())
        logger.info("model %s gets --max-memory %s: what --models-memory-budget %s leaves "
                    "beside %d loaded model(s)", entry.name, format_size(given),
                    format_size(room.budget), len(self.loaded))  # fmt: skip
        return given

    async def _unload(self, model: LoadedModel, reason: str, evicted: bool = True) -> None:
        """Unload an idle model now (the caller holds the lock)."""
        self._take_out(model, reason, evicted)
        await self._stop(model)

    def _take_out(self, model: LoadedModel, reason: str, evicted: bool) -> None:
        """New requests no longer reach it; it still counts against the budget (retired)
        until it stopped."""
        name = model.entry.name
        if self.loaded.get(name) is model:
            del self.loaded[name]
        self.retired.add(model)
        self.metrics.model_loaded.labels(name).set(0)
        if evicted:
            self.metrics.model_evictions.labels(name).inc()
        pending = len(model.manager.pending) if model.manager else 0
        logger.info("unloading model %s (%s; %d request(s) in flight)", name, reason, pending)

    async def _stop(self, model: LoadedModel) -> None:
        """Stop a model taken out, once its requests in flight are done."""
        await model.drain(RETIRE_TIMEOUT)
        await model.stop()
        self.retired.discard(model)
        if model.entry.name not in self.loaded:  # (not loaded again meanwhile)
            model.metrics.observe_unloaded(model.replica.id)
        logger.info("model %s unloaded", model.entry.name)

    async def keep(self) -> None:
        """Unload models idle longer than --model-idle-timeout (a busy model's idle time
        starts when its last request ends) and those whose pair crash-looped (the next
        request loads them afresh)."""
        while True:
            await asyncio.sleep(KEEP_INTERVAL)
            for model in list(self.loaded.values()):
                try:
                    await self._keep(model)
                except Exception:  # one model's failure to stop must not end the keeping
                    logger.exception("model %s: unloading failed", model.entry.name)

    async def _keep(self, model: LoadedModel) -> None:
        now, timeout = time.monotonic(), self.args.model_idle_timeout
        if model.gave_up.is_set():
            async with self.lock:
                if self.loaded.get(model.entry.name) is model:
                    await self._unload(model, "its processes crash-looped", evicted=False)
        elif model.busy:
            model.last_used = now
        elif timeout is not None and model.entry.name not in self.pinned:
            if now - model.last_used > timeout and not self.lock.locked():
                async with self.lock:
                    if not model.busy and self.loaded.get(model.entry.name) is model:
                        await self._unload(model, f"idle for {timeout:g} s, --model-idle-timeout")

    # ------------------------------------------------------------ shutdown (as a manager's)

    def _models(self) -> list[LoadedModel]:
        return [*self.loaded.values(), *self.retired]

    @property
    def pending(self) -> dict:
        return {rid: p for m in self._models() if m.manager for rid, p in m.manager.pending.items()}

    def draining(self) -> None:
        self.state, self.reason = "draining", "draining: the server is shutting down"

    def stopped(self, reason: str) -> None:
        self.state, self.reason = "stopped", reason
        for model in self._models():
            if model.manager:
                model.manager.stopped(reason)

    def fail_all(self, reason: str) -> None:
        for model in self._models():
            if model.manager:
                model.manager.fail_all(reason)

    async def close(self) -> None:
        for task in self.loading.values():
            task.cancel()
        await asyncio.gather(*(m.stop("the server stopped") for m in self._models()))
