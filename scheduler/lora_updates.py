"""The LoRA adapters a scheduler serves, and the updates to them under way
(/admin/loras/load and /unload, common.messages.LoraUpdate).

An unload takes effect for new requests at once (they are refused as for an unknown
adapter), and reaches the worker only once the adapter's requests already admitted are
done: never under requests in flight. A load reaches the worker at once; its id serves
once the worker loaded it. The process runs each update between two steps
(scheduler.process)."""

from __future__ import annotations

from collections.abc import Iterable

from common.messages import LoraUpdate, LoraUpdated, WorkerError
from scheduler.request import Req


class LoraUpdates:
    def __init__(self, count: int):
        self.ids = set(range(1, count + 1))  # the --lora flags' adapters (0: the base)
        self.queue: list[LoraUpdate] = []

    def serves(self, lora: int) -> bool:
        return lora == 0 or lora in self.ids

    def add(self, msg: LoraUpdate) -> LoraUpdated | None:
        """Queue `msg`; the answer now if it is refused."""
        problem = msg.problem()
        queued = {m.lora for m in self.queue}
        if problem is None and msg.path and (msg.lora in self.ids or msg.lora in queued):
            problem = f"LoRA adapter id {msg.lora} is in use"
        if problem is None and not msg.path and msg.lora not in self.ids:
            problem = f"no LoRA adapter of id {msg.lora} is loaded"
        if problem is not None:
            return LoraUpdated(msg.rid, msg.lora, problem, msg.step)
        if not msg.path:
            self.ids.discard(msg.lora)  # its new requests are refused from now on
        self.queue.append(msg)
        return None

    def take(self, reqs: Iterable[Req]) -> LoraUpdate | None:
        """The first update the worker may run now: an unload once no request of its
        adapter is left."""
        busy = {r.lora for r in reqs}
        for msg in self.queue:
            if msg.path or msg.lora not in busy:
                self.queue.remove(msg)
                return msg
        return None

    def done(self, msg: LoraUpdate, reply: LoraUpdated | WorkerError) -> LoraUpdated:
        """The router's answer to `msg`, given the worker's; a loaded adapter serves."""
        if isinstance(reply, WorkerError):
            return LoraUpdated(msg.rid, msg.lora, reply.message, msg.step)
        if msg.path and not reply.error:
            self.ids.add(msg.lora)
        return reply
