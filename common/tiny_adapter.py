"""Seeded random LoRA adapters for the tiny models, in mlx-lm's adapter format.

`mlx_lm.lora` writes an adapter as a directory of `adapter_config.json` (the base model,
`fine_tune_type`, `num_layers` counted from the last layer, and `lora_parameters`: rank,
scale, dropout, the layer keys) and `adapters.safetensors` (`<module path>.lora_a` of
shape (in, rank) and `.lora_b` of shape (rank, out) per adapted linear layer), which
`mlx_lm.load(path, adapter_path=...)` applies. A trained adapter's `lora_b` starts at
zero; here both are random and `lora_b` is not zero, so an adapter's greedy tokens differ
from the base model's and from another seed's (what the tests need to tell them apart).

Usage::

    python -m common.tiny_adapter MODEL_DIR OUT [--seed N] [--rank R] [--num-layers N]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

DEFAULT_KEYS = ("self_attn.q_proj", "self_attn.v_proj")
# mlx-lm's default scale is 20 with lora_b trained from zero; random lora_b of unit-ish
# entries needs a smaller one to perturb the model without swamping it.
DEFAULT_SCALE = 2.0


def build_tiny_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    seed: int = 0,
    rank: int = 4,
    num_layers: int = 2,
    keys: tuple[str, ...] = DEFAULT_KEYS,
    scale: float = DEFAULT_SCALE,
) -> Path:
    """Write a LoRA adapter of the tiny model at `model_dir` to `out_dir`: rank `rank`
    updates of `keys` in its last `num_layers` layers, weights drawn from `seed`."""
    base, out = Path(model_dir), Path(out_dir)
    config = json.loads((base / "config.json").read_text())
    total = config["num_hidden_layers"]
    base_weights = mx.load(str(base / "model.safetensors"))  # lazy: shapes only
    rng = np.random.default_rng(seed)
    weights = {}
    for layer in range(max(total - num_layers, 0), total):
        for key in keys:
            prefix = f"model.layers.{layer}.{key}"
            out_dims, in_dims = base_weights[f"{prefix}.weight"].shape
            bound = 1.0 / np.sqrt(in_dims)  # lora_a as mlx-lm initialises it
            a = rng.uniform(-bound, bound, size=(in_dims, rank)).astype(np.float32)
            b = rng.normal(0.0, 1.0 / np.sqrt(rank), size=(rank, out_dims)).astype(np.float32)
            weights[f"{prefix}.lora_a"] = mx.array(a)
            weights[f"{prefix}.lora_b"] = mx.array(b)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    adapter_config = {
        "model": str(base),
        "fine_tune_type": "lora",
        "num_layers": num_layers,
        "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(keys)},
        "seed": seed,
    }
    text = json.dumps(adapter_config, indent=2, sort_keys=True) + "\n"
    (out / "adapter_config.json").write_text(text)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m common.tiny_adapter", description=__doc__)
    p.add_argument("model", type=Path, help="the tiny model's directory")
    p.add_argument("out", type=Path, help="the adapter directory to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--num-layers", type=int, default=2)
    args = p.parse_args(argv)
    build_tiny_adapter(
        args.model, args.out, seed=args.seed, rank=args.rank, num_layers=args.num_layers
    )
    print(f"wrote a rank-{args.rank} adapter of {args.model} to {args.out}")


if __name__ == "__main__":
    main()
