"""LoRA adapters on the command line (`--lora NAME=PATH`) and their check against the base.

An adapter is what `mlx_lm.lora` writes: a directory with `adapter_config.json`
(`fine_tune_type`, `lora_parameters` with its `scale`) and `adapters.safetensors`, whose
tensors are `<module path>.lora_a` (in, rank) and `<module path>.lora_b` (rank, out) per
adapted linear layer of the base model. The router checks every adapter against the
model directory before any process starts, from the safetensors headers alone (no mlx,
nothing loaded): each adapted module must be a linear layer of the base with those input
and output widths. So an adapter of another base (another width, another layer count) is
refused with one line; one of a base with the same shapes is not told apart (a fine-tune
of the same architecture is exactly what an adapter is for). The worker applies them
(worker_mlx/lora.py); ids are the flags' order from 1 (0: the base model), and an adapter
loaded at run time (/admin/loras/load) gets the next id never used in that pair's life.

With several models an adapter belongs to one: `--lora BASE:NAME=PATH` names it, else
it is the one served model the adapter applies to (`match_base`; none or several:
refused, naming them).

Imports no mlx: the router and the scheduler use it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapters.safetensors"


@dataclass(frozen=True)
class LoraSpec:
    name: str
    path: str
    base: str = ""  # the model it adapts, as `--lora BASE:NAME=PATH` named it ("": not named)

    @property
    def flag(self) -> str:
        return f"--lora {self.base + ':' if self.base else ''}{self.name}={self.path}"


def parse_lora(value: str, base_names: list[str]) -> LoraSpec:
    """One `[BASE:]NAME=PATH`; ValueError names what is wrong with it."""
    named, sep, path = value.partition("=")
    base, _, name = named.rpartition(":")  # a base's own name may hold ':' (qwen3:8b)
    if not sep or not name or not path:
        raise ValueError(f"--lora {value}: expected NAME=PATH or BASE:NAME=PATH")
    if name in base_names:
        raise ValueError(f"--lora {value}: a name without ':' other than the model's")
    return LoraSpec(name, path, base)


def parse_lora_flags(values: list[str] | None, base_names: list[str]) -> list[LoraSpec]:
    """The `--lora [BASE:]NAME=PATH` flags in order (adapter id i + 1); ValueError names a
    bad one."""
    specs: list[LoraSpec] = []
    for value in values or []:
        spec = parse_lora(value, base_names)
        if spec.name in (s.name for s in specs):
            raise ValueError(f"--lora {value}: the name {spec.name!r} is given twice")
        specs.append(spec)
    return specs


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, read from a safetensors file's header only."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def adapter_targets(path: str | Path) -> tuple[dict, dict[str, tuple[int, int, int]]]:
    """(adapter_config, module path -> (in, rank, out)) of the adapter at `path`;
    ValueError says what is missing or not a plain LoRA adapter."""
    root = Path(path)
    if not (root / ADAPTER_CONFIG).is_file() or not (root / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} in {root}")
    config = json.loads((root / ADAPTER_CONFIG).read_text())
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise ValueError(f"fine_tune_type {kind!r}: only LoRA adapters are served per request")
    if "scale" not in config.get("lora_parameters", {}):
        raise ValueError("adapter_config.json has no lora_parameters.scale")
    shapes = safetensors_shapes(root / ADAPTER_WEIGHTS)
    targets = {}
    for name, shape in shapes.items():
        module, _, leaf = name.rpartition(".")
        if leaf not in ("lora_a", "lora_b"):
            raise ValueError(f"tensor {name}: only lora_a and lora_b are served (no DoRA)")
        other = shapes.get(f"{module}.{'lora_b' if leaf == 'lora_a' else 'lora_a'}")
        a, b = (shape, other) if leaf == "lora_a" else (other, shape)
        if a is None or b is None or len(a) != 2 or len(b) != 2 or a[1] != b[0]:
            raise ValueError(f"{module}: lora_a {a} and lora_b {b} are not a low-rank pair")
        targets[module] = (a[0], a[1], b[1])
    if not targets:
        raise ValueError(f"{ADAPTER_WEIGHTS} holds no lora_a / lora_b tensors")
    return config, targets


def _linear_widths(model_dir: Path) -> dict[str, tuple[int, int]]:
    """Module path -> (in, out) of every linear layer of the base (its `.weight`; a
    quantized one's input width from its scales' groups)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        shapes.update(safetensors_shapes(file))
    config = json.loads((model_dir / "config.json").read_text())
    group = (config.get("quantization") or {}).get("group_size", 64)
    widths = {}
    for name, shape in shapes.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and len(shape) == 2:
            scales = shapes.get(f"{module}.scales")
            widths[module] = (scales[1] * group if scales else shape[1], shape[0])
    return widths


def adapter_problem(model_dir: str | Path, adapter_path: str | Path) -> str | None:
    """Why the adapter at `adapter_path` cannot apply to the model at `model_dir` (None:
    it can): each adapted module must be a linear layer of the base of its widths."""
    try:
        _, targets = adapter_targets(adapter_path)
    except (ValueError, OSError) as exc:
        return str(exc)
    widths = _linear_widths(Path(model_dir))
    for module, (in_dims, _, out_dims) in sorted(targets.items()):
        if module not in widths:
            return f"it adapts {module}, which the base model has no linear layer at"
        if widths[module] != (in_dims, out_dims):
            base_in, base_out = widths[module]
            return (
                f"it adapts {module} as {in_dims} -> {out_dims}, the base model's is "
                f"{base_in} -> {base_out}: an adapter of another base"
            )
    return None


def match_base(spec: LoraSpec, models: dict[str, str]) -> str:
    """The one of `models` (name -> model directory) the adapter applies to; ValueError
    (one line) when none does or several do (then `--lora BASE:NAME=PATH` decides)."""
    problems = {name: adapter_problem(path, spec.path) for name, path in models.items()}
    fits = [name for name, problem in problems.items() if problem is None]
    if len(fits) == 1:
        return fits[0]
    if fits:
        raise ValueError(
            f"{spec.flag}: the adapter applies to the models {fits}: name its base as "
            f"BASE:{spec.name}=PATH"
        )
    why = "; ".join(f"{name}: {problem}" for name, problem in problems.items())
    raise ValueError(f"{spec.flag}: the adapter applies to none of the models ({why})")


def check_loras(model_dir: str, specs: list[LoraSpec]) -> None:
    """ValueError (one line, naming the flag) for the first adapter that cannot apply."""
    for spec in specs:
        problem = adapter_problem(model_dir, spec.path)
        if problem:
            raise ValueError(f"{spec.flag}: cannot serve this adapter: {problem}")
