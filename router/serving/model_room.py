"""What a model's load needs room for, under --max-loaded-models and
--models-memory-budget: the pure decisions of router.serving.model_pool (which model
goes, what the budget leaves, a model too large for any room); the pool does the
loading and unloading they call for."""

from __future__ import annotations

import time
from collections.abc import Iterable

from common.server_args import ServerArgs
from common.sizes import format_size, parse_size
from router.request_error import RequestError
from router.serving.loaded_model import LoadedModel
from router.serving.model_registry import ModelEntry

GRACE = 1.0  # seconds a model chosen by a request is not unloaded (see model_pool)


class ModelRoom:
    def __init__(self, args: ServerArgs):
        self.max_loaded = args.max_loaded_models
        self.budget = parse_size(args.models_memory_budget) if args.models_memory_budget else None
        self.pinned = set(args.pin_model or [])

    def share(self) -> int | None:
        """The most one model's worker may get of the budget."""
        if self.budget is None:
            return None
        return self.budget // (self.max_loaded or 1)

    def free(self, holding: Iterable[LoadedModel], old: LoadedModel | None) -> int:
        """What the budget leaves beside `holding` (loaded and retired models); in a swap
        the new version takes the old one's share (both run while the old one finishes
        its requests)."""
        return self.budget - sum(m.footprint for m in holding if m is not old)

    def refuse_too_large(self, entry: ModelEntry) -> None:
        weights, share = entry.weights_bytes(), self.share()
        if share is None or weights <= share:
            return
        of = f"--models-memory-budget {format_size(self.budget)}"
        if share != self.budget:
            of += f" / --max-loaded-models {self.max_loaded} = {format_size(share)}"
        raise RequestError(
            f"model {entry.name!r} does not fit: its weights alone are {format_size(weights)}, "
            f"over {of}", "insufficient_memory", 400, param="model",
        )  # fmt: skip

    def needs_room(
        self, entry: ModelEntry, loaded: list[LoadedModel], holding: list[LoadedModel],
        old: LoadedModel | None,
    ) -> bool:  # fmt: skip
        others = [m for m in loaded if m is not old]
        if self.max_loaded is not None and len(others) >= self.max_loaded:
            return True
        return self.budget is not None and self.free(holding, old) < entry.weights_bytes()

    def victim(self, loaded: list[LoadedModel], spare: LoadedModel | None) -> LoadedModel | None:
        """The least recently used model that is not pinned and idle."""
        now = time.monotonic()
        idle = [
            m for m in loaded
            if m is not spare and m.entry.name not in self.pinned
            and not m.busy and now - m.last_used > GRACE
        ]  # fmt: skip
        return min(idle, key=lambda m: m.last_used, default=None)

    def movable(self, loaded: list[LoadedModel], old: LoadedModel | None) -> list[LoadedModel]:
        """What could still go once idle (not `old`, not pinned)."""
        return [m for m in loaded if m is not old and m.entry.name not in self.pinned]

    def why_kept(self, model: LoadedModel) -> str:
        return "pinned" if model.entry.name in self.pinned else "busy"
