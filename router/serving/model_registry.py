"""What models a server with several offers (`--model-path` repeated, `--model-dir`) and
the names a request may give for each: its directory's name, the path as given,
`--served-model-name` (the first model's names, the first the one it is listed and
reported under) and `--model-alias` globs
(`PATTERN=MODEL`, or a bare PATTERN for the first model).

Each LoRA adapter (`--lora [BASE:]NAME=PATH`, or loaded at run time) belongs to one
entry, its base: a request naming `NAME` or `BASE:NAME` gets that entry, and its pair
serves the adapter (it loads with its model). An adapter without BASE goes to the one
model it applies to (common.lora_adapters.match_base); a name is a model's or an
adapter's, never both.
"""

from __future__ import annotations

import dataclasses
import os
from fnmatch import fnmatchcase
from pathlib import Path

from common.lora_adapters import LoraSpec, check_loras, match_base
from common.server_args import ServerArgs, default_model_name
from common.sizes import format_size
from router.api.model_names import ModelNames
from router.request_error import RequestError
from router.serving.model_files import resolve_model_path

WEIGHT_SUFFIXES = (".safetensors", ".npz", ".gguf")  # what mlx_lm.load reads weights from


@dataclasses.dataclass
class ModelEntry:
    name: str  # the id /v1/models lists and responses report
    path: str  # the local model directory
    given: str = ""  # the path as the flag gave it (also accepted as the model's id)
    aliases: list[str] = dataclasses.field(default_factory=list)  # globs of other ids
    extra_names: list[str] = dataclasses.field(default_factory=list)  # --served-model-name
    loras: list[LoraSpec] = dataclasses.field(default_factory=list)  # its adapters (base: it)

    def names(self) -> ModelNames:
        """The names its requests may give (router.api.model_names); its adapters' ids
        are their order, as its pair loads them from `lora_flags`."""
        return ModelNames([self.name, *self.extra_names], self.aliases, self.given or self.path,
                          [spec.name for spec in self.loras])  # fmt: skip

    def lora_flags(self) -> list[str]:
        """The --lora values its pair gets (the base is the pair's one model)."""
        return [f"{spec.name}={os.path.abspath(spec.path)}" for spec in self.loras]

    def adapts(self, name: str) -> bool:
        """`name` is `NAME` or `BASE:NAME` of one of its adapters."""
        base, _, lora = name.rpartition(":")
        mine = any(spec.name == lora for spec in self.loras)
        return mine and (not base or self.named(base))

    def named(self, name: str) -> bool:
        """`name` is one of its own names (not only a match of an alias glob)."""
        return name in (self.name, self.given or self.path) or name in self.extra_names

    def answers(self, name: str) -> bool:
        return self.named(name) or any(fnmatchcase(name, pattern) for pattern in self.aliases)

    def weights_bytes(self) -> int:
        """The size of its weight files: the least memory it can load in."""
        return sum(p.stat().st_size for p in Path(self.path).iterdir()
                   if p.name.endswith(WEIGHT_SUFFIXES))  # fmt: skip

    def describe_weights(self) -> str:
        return format_size(self.weights_bytes())


def is_model_dir(path: Path) -> bool:
    """An mlx-lm model directory: config.json and weights."""
    if not (path / "config.json").is_file():
        return False
    return any(p.name.endswith(WEIGHT_SUFFIXES) for p in path.iterdir())


class ModelRegistry:
    """The models, in the order given (the --model-path ones, then --model-dir's sorted by
    name); the first is the one a request without a model gets."""

    def __init__(self, entries: list[ModelEntry]):
        self.entries: dict[str, ModelEntry] = {}
        for entry in entries:
            self.add(entry)

    @classmethod
    def from_args(cls, args: ServerArgs) -> ModelRegistry:
        """ValueError (ModelNotFound) naming the flag for a path, alias or pin that is wrong."""
        entries = [_entry(resolve_model_path(p), p) for p in args.model_paths]
        if args.model_dir:
            root = Path(args.model_dir).expanduser()
            if not root.is_dir():
                raise ValueError(f"--model-dir {args.model_dir}: no such directory")
            found = sorted(p for p in root.iterdir() if p.is_dir() and is_model_dir(p))
            if not found:
                raise ValueError(f"--model-dir {args.model_dir}: no model directory in it")
            entries += [_entry(str(p.resolve()), str(p)) for p in found]
        if args.served_model_name and entries:  # the first model's names, as with one model
            first, *others = args.served_model_name
            entries[0].name, entries[0].extra_names = first, others
        registry = cls(entries)
        for alias in args.model_alias or []:
            pattern, _, model = alias.rpartition("=") if "=" in alias else (alias, "", "")
            target = registry.entries.get(model) if model else registry.first
            if target is None:
                raise ValueError(f"--model-alias {alias}: no model {model!r}")
            target.aliases.append(pattern)
        for name in args.pin_model or []:
            if name not in registry.entries:
                raise ValueError(f"--pin-model {name}: no such model ({registry.listing()})")
        for spec in args.loras:
            registry.add_lora(spec)
        return registry

    def base_of(self, spec: LoraSpec) -> ModelEntry:
        """The model the adapter belongs to: its BASE, else the one it applies to;
        ValueError (one line) if none, or it does not apply to its BASE."""
        for entry in self.entries.values():  # (an alias glob may match it: the adapter wins)
            if entry.named(spec.name) or any(s.name == spec.name for s in entry.loras):
                raise ValueError(f"{spec.flag}: {spec.name!r} is already a model's name")
        if not spec.base:
            return self.entries[match_base(spec, {e.name: e.path for e in self})]
        base = next((e for e in self if e.named(spec.base)), None) or next(
            (e for e in self if e.answers(spec.base)), None
        )
        if base is None:
            raise ValueError(f"{spec.flag}: no model {spec.base!r}; {self.listing()}")
        check_loras(base.path, [spec])
        return base

    def add_lora(self, spec: LoraSpec) -> ModelEntry:
        """Give the adapter to its base (see `base_of`); the base."""
        base = self.base_of(spec)
        base.loras.append(spec)
        return base

    def add(self, entry: ModelEntry) -> None:
        if entry.name in self.entries and self.entries[entry.name].path != entry.path:
            raise ValueError(
                f"two models named {entry.name!r}: {self.entries[entry.name].path} and {entry.path}"
            )
        self.entries[entry.name] = entry

    @property
    def first(self) -> ModelEntry:
        return next(iter(self.entries.values()))

    def listing(self) -> str:
        return "serving " + ", ".join(repr(name) for name in self.entries)

    def find(self, name: str | None) -> ModelEntry:
        """The model a request naming `name` gets (none: the first); else a 404 naming it."""
        if not name:
            return self.first
        if name in self.entries:
            return self.entries[name]
        for entry in self.entries.values():  # before the globs: `--model-alias '*'`
            if entry.adapts(name):
                return entry
        for entry in self.entries.values():
            if entry.answers(name):
                return entry
        raise RequestError(f"model {name!r} does not exist; {self.listing()}",
                           "model_not_found", 404, param="model")  # fmt: skip

    def __iter__(self):
        return iter(self.entries.values())


def _entry(path: str, given: str) -> ModelEntry:
    return ModelEntry(default_model_name(os.path.abspath(given) if given.startswith(".")
                                         else given), path, given)  # fmt: skip
