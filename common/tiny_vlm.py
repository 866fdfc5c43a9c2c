"""Build tiny random-weight vision-language models that load offline with ``mlx_vlm.load``.

The VLM counterpart of ``common/tiny_model.py``: the model is mlx-vlm's own class (the
vision tower, its merger and the language model) with seeded random weights, the
tokenizer is the text builder's byte-level BPE plus the family's vision special tokens,
and the directory holds the processor configs mlx-vlm's processor reads, so
``mlx_vlm.load(path)`` gives a model and a processor with no download.

The families (``VLM_FAMILIES``: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Gemma 3) and what each
one's directory holds are in ``common/tiny_vlm_families.py``.

Usage::

    python -m common.tiny_vlm OUT [--arch qwen2_5_vl] [--seed 0] [--preset tiny]
                                  [--image-tokens 16]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from common.tiny_model import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    _write_json,
    default_cache_dir,
    train_tokenizer,
)
from common.tiny_presets import PRESETS
from common.tiny_vlm_families import VLM_FAMILY_SPECS, write_processor_files
from common.tiny_weights import random_weights

# Bump whenever the builder's output changes, so cached models are rebuilt.
VLM_BUILDER_VERSION = 2


def _write_vlm_tokenizer(out: Path, vocab_size: int, arch: str) -> dict[str, int]:
    """The text builder's BPE with the family's vision tokens as added special tokens."""
    family = VLM_FAMILY_SPECS[arch]
    tokenizer = train_tokenizer(vocab_size)
    tokenizer.add_special_tokens(family.tokens)
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
            "unk_token": None,
            "add_bos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 32768,
            "chat_template": family.chat_template,
            **(family.tokenizer_extra or {}),
        },
    )
    _write_json(out / "special_tokens_map.json", {"eos_token": IM_END, "pad_token": ENDOFTEXT})
    ids = {t: tokenizer.token_to_id(t) for t in [ENDOFTEXT, IM_START, IM_END, *family.tokens]}
    ids.update(eos=ids[IM_END], pad=ids[ENDOFTEXT])
    ids["vocab_size"] = tokenizer.get_vocab_size(with_added_tokens=True)
    return ids


def _random_vlm_weights(
    config: dict[str, Any], seed: int, norm_offset: float = 0.0
) -> dict[str, mx.array]:
    """mlx-vlm's model class for ``config`` with the text builder's seeded init (Gemma's
    ``1 + weight`` norms offset outside the vision tower, whose LayerNorms are plain)."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    arch, _ = get_model_and_args(config)
    # As mlx_vlm.load does: from_dict fills a missing text_config from the top-level keys.
    loaded = {**config, "text_config": config.get("text_config", {})}
    model_config = arch.ModelConfig.from_dict(loaded)
    model_config = update_module_configs(model_config, arch, loaded, ["text", "vision"])
    mx.random.seed(seed)
    model = arch.Model(model_config)
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    hidden = loaded["text_config"].get("hidden_size", config.get("hidden_size"))
    weights = random_weights(shapes, hidden, seed, 1.0)
    for k, v in weights.items():
        if norm_offset and k.endswith("norm.weight") and not k.startswith("vision_tower"):
            weights[k] = v - norm_offset
    model.update(tree_unflatten([(k, mx.array(v)) for k, v in weights.items()]))
    return dict(tree_flatten(model.parameters()))


def build_tiny_vlm(
    out_dir: str | Path,
    *,
    arch: str = "qwen2_5_vl",
    preset: str = "tiny",
    seed: int = 0,
    image_tokens: int = 16,
) -> Path:
    """Write a complete VLM directory (weights, config, tokenizer, processor) to ``out_dir``;
    a Qwen-VL family's processor gives an image at most ``image_tokens`` tokens."""
    if arch not in VLM_FAMILIES:
        raise ValueError(f"unknown vision arch {arch!r}; expected one of {VLM_FAMILIES}")
    family = VLM_FAMILY_SPECS[arch]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = _write_vlm_tokenizer(out, 512, arch)
    config = family.config(arch, PRESETS[preset], ids)
    weights = _random_vlm_weights(config, seed, family.norm_offset)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {"eos_token_id": ids[IM_END], "pad_token_id": ids[ENDOFTEXT]},
    )
    write_processor_files(out, arch, _write_json, image_tokens)
    return out


VLM_FAMILIES = tuple(VLM_FAMILY_SPECS)


def ensure_tiny_vlm(
    cache_dir: str | Path | None = None,
    arch: str = "qwen2_5_vl",
    seed: int = 0,
    preset: str = "tiny",
    image_tokens: int = 16,
) -> Path:
    """A cached tiny VLM directory, built once (in a temp dir renamed into place, so
    concurrent builders and readers only ever see complete directories)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    size = "" if (preset, image_tokens) == ("tiny", 16) else f"-{preset}-i{image_tokens}"
    final = cache / f"tiny-vlm-{arch}{size}-s{seed}-v{VLM_BUILDER_VERSION}"
    if final.is_dir():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=cache))
    try:
        build_tiny_vlm(tmp, arch=arch, seed=seed, preset=preset, image_tokens=image_tokens)
        tmp.chmod(0o755)
        with contextlib.suppress(OSError):
            os.rename(tmp, final)
        if not final.is_dir():
            raise OSError(f"could not place the tiny VLM at {final}")
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(tmp)
    return final


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: build one tiny VLM and print where it went."""
    p = argparse.ArgumentParser(
        prog="python -m common.tiny_vlm", description=__doc__.split("\n")[0]
    )
    p.add_argument("out", type=Path)
    p.add_argument("--arch", choices=VLM_FAMILIES, default="qwen2_5_vl")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--image-tokens", type=int, default=16, help="Qwen-VL: per image, at most")
    args = p.parse_args(argv)
    out = build_tiny_vlm(
        args.out, arch=args.arch, seed=args.seed, preset=args.preset,
        image_tokens=args.image_tokens,
    )  # fmt: skip
    print(f"wrote {args.arch} tiny VLM to {out}")


if __name__ == "__main__":
    main()
