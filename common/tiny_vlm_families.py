"""The vision families the tiny VLM builder knows: each one's ``config.json``, its vision
special tokens, its chat template and the processor files mlx-vlm's processor reads.

- ``qwen2_5_vl``: Qwen2.5-VL. A 2-block windowed ViT (14-pixel patches, 2x2 merge) whose
  merger projects to the language model's width, and the multimodal RoPE (t, h, w
  sections) language model;
- ``qwen2_vl``: Qwen2-VL, the same language model after a 2-block global-attention ViT;
- ``qwen3_vl``: Qwen3-VL. A ViT with 16-pixel patches, interpolated position embeddings
  and *deepstack* mergers (the features of its blocks added to the first language layers'
  hidden states at the image's positions), and a Qwen3 language model (q/k norms) whose
  M-RoPE sections are interleaved;
- ``gemma3``: Gemma 3's vision variant. A SigLIP tower over a fixed-size square image,
  average-pooled to ``mm_tokens_per_image`` soft tokens, and Gemma 3's text model (local
  sliding-window and global layers, plain 1-D RoPE).

Pixel budgets are small (at most 16 image tokens per image) so tests stay cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.tiny_families import family_config

Config = dict[str, Any]

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
QWEN_VL_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]

BOI = "<start_of_image>"
EOI = "<end_of_image>"
IMAGE_SOFT = "<image_soft_token>"
GEMMA3_TOKENS = [BOI, EOI, IMAGE_SOFT]

PATCH = 14
MERGE = 2
GEMMA3_IMAGE = 112  # SigLIP's square input: 8 x 8 patches of 14 pixels
GEMMA3_TOKENS_PER_IMAGE = 16  # pooled 2 x 2: 4 x 4 soft tokens


def _template(image_text: str, text: str = "part['text']") -> str:
    """The builder's chat format: an image part is `image_text`, a text part `text`."""
    return (
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['content'] is string %}{{- message['content'] }}"
        "{%- else %}{%- for part in message['content'] %}"
        "{%- if part['type'] in ('image', 'image_url') %}"
        "{{- '" + image_text + "' }}"
        "{%- elif part['type'] == 'text' %}{{- " + text + " }}{%- endif %}"
        "{%- endfor %}{%- endif %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


# Qwen2-VL's template writes the vision run; Gemma 3's writes the begin-of-image token,
# which its processor expands to "\n\n<boi><image_soft_token>*N<eoi>\n\n", and trims
# text parts, as the official one does.
QWEN_VL_CHAT_TEMPLATE = _template(VISION_START + IMAGE_PAD + VISION_END)
GEMMA3_CHAT_TEMPLATE = _template(BOI, "part['text'] | trim")


def _qwen2_5_vl_tower(dims: dict[str, int]) -> Config:
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


def _qwen2_vl_tower(dims: dict[str, int]) -> Config:
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


def _mrope_sections(head_dim: int) -> list[int]:
    half = head_dim // 2
    return [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]  # 16:24:24 at 128


def _vision_ids(ids: dict[str, int]) -> Config:
    return {
        "image_token_id": ids[IMAGE_PAD],
        "video_token_id": ids[VIDEO_PAD],
        "vision_start_token_id": ids[VISION_START],
        "vision_end_token_id": ids[VISION_END],
    }


def _qwen_vl_config(arch: str, dims: dict[str, int], ids: dict[str, int]) -> Config:
    """A Qwen2(.5)-VL ``config.json``: the language model's keys at the top (as the HF
    checkpoints have them), the vision tower's under ``vision_config``."""
    architecture, tower = {
        "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", _qwen2_5_vl_tower),
        "qwen2_vl": ("Qwen2VLForConditionalGeneration", _qwen2_vl_tower),
    }[arch]
    head_dim = dims["hidden"] // dims["heads"]  # mlx-vlm's qwen2_5_vl derives it so
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
        "rope_scaling": {"type": "mrope", "mrope_section": _mrope_sections(head_dim)},
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "eos_token_id": ids["eos"],
        **_vision_ids(ids),
        "vision_config": tower(dims),
    }


def _text_sizes(dims: dict[str, int], ids: dict[str, int], layers: int) -> Config:
    """The language model's sizes, as the Qwen3-VL and Gemma 3 text configs name them."""
    return {
        "hidden_size": dims["hidden"],
        "num_hidden_layers": layers,
        "intermediate_size": dims["intermediate"],
        "num_attention_heads": dims["heads"],
        "num_key_value_heads": dims["kv_heads"],
        "head_dim": dims["head_dim"],
        "rms_norm_eps": 1e-6,
        "vocab_size": ids["vocab_size"],
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
    }


def _qwen3_vl_config(arch: str, dims: dict[str, int], ids: dict[str, int]) -> Config:
    """A Qwen3-VL ``config.json``: the language model's keys under ``text_config``, as
    the HF checkpoints have them; two deepstack mergers (after each ViT block)."""
    text = {
        "model_type": "qwen3_vl",
        **_text_sizes(dims, ids, dims["layers"]),
        "rope_scaling": {
            "rope_type": "default",
            "mrope_section": _mrope_sections(dims["head_dim"]),
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": True,
    }
    vision = {
        "model_type": "qwen3_vl",
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": dims["hidden"],
        "patch_size": 16,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": 2,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0, 1],
        "in_channels": 3,
    }
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "eos_token_id": ids["eos"],
        **_vision_ids(ids),
        "text_config": text,
        "vision_config": vision,
    }


def _gemma3_config(arch: str, dims: dict[str, int], ids: dict[str, int]) -> Config:
    """Gemma 3's vision variant: the text builder's Gemma 3 config (L L G L layers,
    16-token windows) under ``text_config``, a 2-layer SigLIP under ``vision_config``."""
    common = {**_text_sizes(dims, ids, max(dims["layers"], 4)), "tie_word_embeddings": True}
    text = family_config("gemma3", common)
    text.pop("architectures")
    text.update(mm_tokens_per_image=GEMMA3_TOKENS_PER_IMAGE, rope_global_base_freq=10000.0)
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "torch_dtype": "float32",
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
        "image_token_index": ids[IMAGE_SOFT],
        "boi_token_index": ids[BOI],
        "eoi_token_index": ids[EOI],
        "mm_tokens_per_image": GEMMA3_TOKENS_PER_IMAGE,
        "hidden_size": dims["hidden"],
        "text_config": text,
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "num_hidden_layers": 2,
            "patch_size": PATCH,
            "image_size": GEMMA3_IMAGE,
            "layer_norm_eps": 1e-6,
        },
    }


def _qwen_vl_processor(arch: str, image_tokens: int) -> tuple[Config, Config]:
    """(preprocessor_config.json, processor_config.json) of a Qwen-VL family."""
    patch = 16 if arch == "qwen3_vl" else PATCH
    image = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": {
            "qwen2_5_vl": "Qwen2_5_VLProcessor",
            "qwen2_vl": "Qwen2VLProcessor",
            "qwen3_vl": "Qwen3VLProcessor",
        }[arch],
        "patch_size": patch,
        "temporal_patch_size": 2,
        "merge_size": MERGE,
        # at most `image_tokens` merged tokens (16 by default: 64 patches) per image
        "min_pixels": (patch * MERGE) ** 2 * 4,
        "max_pixels": (patch * MERGE) ** 2 * image_tokens,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }
    return image, {}


def _gemma3_processor(arch: str, image_tokens: int) -> tuple[Config, Config]:
    """Gemma 3's fixed image size (its soft tokens are `mm_tokens_per_image`, whatever
    `image_tokens` asks)."""
    image = {
        "image_processor_type": "Gemma3ImageProcessor",
        "processor_class": "Gemma3Processor",
        "size": {"height": GEMMA3_IMAGE, "width": GEMMA3_IMAGE},
        "do_pan_and_scan": False,
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "rescale_factor": 1 / 255,
        "resample": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    return image, {"image_seq_length": GEMMA3_TOKENS_PER_IMAGE}


@dataclass(frozen=True)
class VisionFamily:
    """How to build one vision ``--arch``."""

    tokens: list[str]  # the vision special tokens its tokenizer adds
    chat_template: str
    config: Callable[[str, dict[str, int], dict[str, int]], Config]
    processor: Callable[[str, int], tuple[Config, Config]]
    # extra tokenizer_config keys (Gemma 3's processor reads these token names from it)
    tokenizer_extra: Config | None = None
    norm_offset: float = 0.0  # Gemma's RMSNorm multiplies by 1 + weight


_QWEN = dict(tokens=QWEN_VL_TOKENS, chat_template=QWEN_VL_CHAT_TEMPLATE)
VLM_FAMILY_SPECS: dict[str, VisionFamily] = {
    "qwen2_5_vl": VisionFamily(**_QWEN, config=_qwen_vl_config, processor=_qwen_vl_processor),
    "qwen2_vl": VisionFamily(**_QWEN, config=_qwen_vl_config, processor=_qwen_vl_processor),
    "qwen3_vl": VisionFamily(**_QWEN, config=_qwen3_vl_config, processor=_qwen_vl_processor),
    "gemma3": VisionFamily(
        tokens=GEMMA3_TOKENS,
        chat_template=GEMMA3_CHAT_TEMPLATE,
        config=_gemma3_config,
        processor=_gemma3_processor,
        tokenizer_extra={
            "extra_special_tokens": {"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE_SOFT}
        },
        norm_offset=1.0,
    ),
}


def write_processor_files(out: Path, arch: str, write_json, image_tokens: int = 16) -> None:
    """The image (and video) processor settings mlx-vlm's processor reads."""
    family = VLM_FAMILY_SPECS[arch]
    image, processor = family.processor(arch, image_tokens)
    write_json(out / "preprocessor_config.json", image)
    if arch != "gemma3":
        write_json(out / "video_preprocessor_config.json", image)
    if processor:
        write_json(out / "processor_config.json", processor)
    write_json(out / "chat_template.json", {"chat_template": family.chat_template})
