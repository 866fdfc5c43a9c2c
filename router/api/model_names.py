"""Which model names the API answers to: the served names (`--served-model-name`,
repeatable; the first is the one responses report), the model path as given, and any name
an alias glob (`--model-alias`) matches, so that an agent's side calls for another model
(`claude-haiku-4-5`) reach the one served. A LoRA adapter (`--lora NAME=PATH`) is named
`NAME`, or `BASE:NAME` with BASE any name of the model. Any other name is a 404.

An adapter's id is what its requests carry to the scheduler and worker: the --lora
flags' order from 1, then (/admin/loras/load) ids never given before in the pair's life,
so a prefix cached under an unloaded adapter's namespace (common/cache_salt.py) is never
served to another."""

from __future__ import annotations

from fnmatch import fnmatchcase

from router.request_error import RequestError


class ModelNames:
    def __init__(
        self, served: list[str], aliases: list[str], model_path: str, loras: list[str] = ()
    ):
        self.served, self.aliases, self.model_path = list(served), list(aliases), model_path
        # the adapters served now: name -> id (the flags' adapter i + 1 is loras[i])
        self.loras: dict[str, int] = {name: i + 1 for i, name in enumerate(loras)}

    @property
    def reported(self) -> str:
        return self.served[0]

    def accepts(self, name: str | None) -> bool:
        """Whether a request naming `name` (none: the served model) is served here."""
        if name in (None, "", self.model_path) or name in self.served:
            return True
        return any(fnmatchcase(name, pattern) for pattern in self.aliases)

    def reported_for(self, name: str | None) -> str:
        """The model a response to a request naming `name` reports: the adapter's name for
        an adapter's request, else the served name."""
        return self.adapter_name(name) or self.reported

    def adapter_name(self, name: str | None) -> str | None:
        """The adapter a request naming `name` (`NAME` or `BASE:NAME`) runs; None: none."""
        base, _, lora = (name or "").rpartition(":")
        return lora if lora in self.loras and (not base or self.accepts(base)) else None

    def adapter(self, name: str | None) -> int | None:
        """The LoRA adapter id a request naming `name` runs (0: the base model); None if
        `name` is neither the model nor one of its adapters. An adapter's own name goes
        before the alias globs (`--model-alias '*'` takes every other name)."""
        lora = self.adapter_name(name)
        if lora is not None:
            return self.loras[lora]
        return 0 if self.accepts(name) else None

    def check(self, name: str | None) -> None:
        if self.adapter(name) is None:
            adapters = f" and the LoRA adapters {list(self.loras)}" if self.loras else ""
            raise RequestError(
                f"model {name!r} does not exist; serving {self.reported!r}{adapters}",
                "model_not_found",
                404,
                param="model",
            )
