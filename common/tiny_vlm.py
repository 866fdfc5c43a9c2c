"""Build tiny random-weight vision-language models that load offline with ``mlx_vlm.load``.

The VLM counterpart of ``common/tiny_model.py``: the model is mlx-vlm's own class (the
vision tower, its merger and the language model) with seeded random weights, the
tokenizer is the text builder's byte-level BPE plus the family's vision special tokens,
and the directory holds the processor configs mlx-vlm's processor reads, so
``mlx_vlm.load(path)`` gives a model and a processor with no download.

Families (``VLM_FAMILIES``):

- ``qwen2_5_vl``: Qwen2.5-VL. A 2-block windowed ViT (14-pixel patches, 2x2 merge) whose
  merger projects to the language model's width, and the multimodal RoPE (t, h, w
  sections) language model;
- ``qwen2_vl``: Qwen2-VL, the same language model after a 2-block global-attention ViT.

The image processor's pixel budget is kept at 16 merged tokens per image so tests stay
cheap.

Usage::

    python -m common.tiny_vlm OUT [--arch qwen2_5_vl] [--seed 0]
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
from common.tiny_weights import random_weights

# Bump whenever the builder's output changes, so cached models are rebuilt.
VLM_BUILDER_VERSION = 1

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
QWEN_VL_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]

PATCH = 14
MERGE = 2
# At most 16 merged tokens (64 patches) per image, at least 4: a test image costs little.
MAX_PIXELS = (PATCH * MERGE) ** 2 * 16
MIN_PIXELS = (PATCH * MERGE) ** 2 * 4

# Qwen2-VL's template: an image part is the vision run, text parts are written as they are.
QWEN_VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] in ('image', 'image_url') %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _qwen2_5_vl_tower(dims: dict[str, int]) -> dict[str, Any]:
    """Qwen2.5-VL's ViT: windowed attention blocks (the last one global), RMSNorm, SwiGLU."""
    return {
        "model_type": "qwen2_5_vl",
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": dims["hidden"],
        "patch_size": PATCH,
        "spatial_patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [1],
        "in_channels": 3,
        "tokens_per_second": 2,
    }


def _qwen2_vl_tower(dims: dict[str, int]) -> dict[str, Any]:
    """Qwen2-VL's ViT: global attention blocks, LayerNorm, a GELU MLP."""
    return {
        "model_type": "qwen2_vl",
        "depth": 2,
        "embed_dim": 32,
        "hidden_size": dims["hidden"],
        "num_heads": 2,
        "mlp_ratio": 2,
        "patch_size": PATCH,
        "spatial_patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": 2,
        "in_channels": 3,
    }


QWEN_VL_TOWERS = {
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", _qwen2_5_vl_tower),
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", _qwen2_vl_tower),
}


def _qwen_vl_config(arch: str, dims: dict[str, int], ids: dict[str, int]) -> dict[str, Any]:
    """A Qwen-VL ``config.json``: the language model's keys at the top (as the HF
    checkpoints have them), the vision tower's under ``vision_config``."""
    architecture, tower = QWEN_VL_TOWERS[arch]
    head_dim = dims["hidden"] // dims["heads"]  # mlx-vlm's qwen2_5_vl derives it so
    half = head_dim // 2
    sections = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]  # 16:24:24 at 128
    return {
        "architectures": [architecture],
        "model_type": arch,
        "hidden_size": dims["hidden"],
        "num_hidden_layers": dims["layers"],
        "intermediate_size": dims["intermediate"],
        "num_attention_heads": dims["heads"],
        "num_key_value_heads": dims["kv_heads"],
        "rms_norm_eps": 1e-6,
        "vocab_size": ids["vocab_size"],
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": sections},
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "eos_token_id": ids[IM_END],
        "image_token_id": ids[IMAGE_PAD],
        "video_token_id": ids[VIDEO_PAD],
        "vision_start_token_id": ids[VISION_START],
        "vision_end_token_id": ids[VISION_END],
        "vision_config": tower(dims),
    }


def _qwen_vl_processor_files(out: Path, arch: str) -> None:
    """The image (and video) processor settings mlx-vlm's Qwen-VL processor reads."""
    image = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor" if arch == "qwen2_5_vl" else "Qwen2VLProcessor",
        "patch_size": PATCH,
        "temporal_patch_size": 2,
        "merge_size": MERGE,
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }
    _write_json(out / "preprocessor_config.json", image)
    _write_json(out / "video_preprocessor_config.json", image)
    _write_json(out / "chat_template.json", {"chat_template": QWEN_VL_CHAT_TEMPLATE})


def _write_vlm_tokenizer(out: Path, vocab_size: int) -> dict[str, int]:
    """The text builder's BPE with the vision tokens as added special tokens."""
    tokenizer = train_tokenizer(vocab_size)
    tokenizer.add_special_tokens(QWEN_VL_TOKENS)
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
            "chat_template": QWEN_VL_CHAT_TEMPLATE,
        },
    )
    _write_json(out / "special_tokens_map.json", {"eos_token": IM_END, "pad_token": ENDOFTEXT})
    ids = {t: tokenizer.token_to_id(t) for t in [ENDOFTEXT, IM_START, IM_END, *QWEN_VL_TOKENS]}
    ids["vocab_size"] = tokenizer.get_vocab_size(with_added_tokens=True)
    return ids


def _random_vlm_weights(config: dict[str, Any], seed: int) -> dict[str, mx.array]:
    """mlx-vlm's model class for ``config`` with the text builder's seeded init."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    arch, _ = get_model_and_args(config)
    # As mlx_vlm.load does: from_dict fills the copy's text_config from its top-level keys.
    loaded = {**config, "text_config": {}}
    model_config = arch.ModelConfig.from_dict(loaded)
    model_config = update_module_configs(model_config, arch, loaded, ["text", "vision"])
    mx.random.seed(seed)
    model = arch.Model(model_config)
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    weights = random_weights(shapes, config["hidden_size"], seed, 1.0)
    model.update(tree_unflatten([(k, mx.array(v)) for k, v in weights.items()]))
    return dict(tree_flatten(model.parameters()))


def build_tiny_vlm(
    out_dir: str | Path, *, arch: str = "qwen2_5_vl", preset: str = "tiny", seed: int = 0
) -> Path:
    """Write a complete VLM directory (weights, config, tokenizer, processor) to ``out_dir``."""
    if arch not in VLM_FAMILIES:
        raise ValueError(f"unknown vision arch {arch!r}; expected one of {VLM_FAMILIES}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = _write_vlm_tokenizer(out, 512)
    config = _qwen_vl_config(arch, PRESETS[preset], ids)
    weights = _random_vlm_weights(config, seed)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {"eos_token_id": ids[IM_END], "pad_token_id": ids[ENDOFTEXT]},
    )
    _qwen_vl_processor_files(out, arch)
    return out


VLM_FAMILIES = tuple(QWEN_VL_TOWERS)


def ensure_tiny_vlm(
    cache_dir: str | Path | None = None, arch: str = "qwen2_5_vl", seed: int = 0
) -> Path:
    """A cached tiny VLM directory, built once (in a temp dir renamed into place, so
    concurrent builders and readers only ever see complete directories)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache / f"tiny-vlm-{arch}-s{seed}-v{VLM_BUILDER_VERSION}"
    if final.is_dir():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=cache))
    try:
        build_tiny_vlm(tmp, arch=arch, seed=seed)
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
    args = p.parse_args(argv)
    print(
        f"wrote {args.arch} tiny VLM to {build_tiny_vlm(args.out, arch=args.arch, seed=args.seed)}"
    )


if __name__ == "__main__":
    main()
