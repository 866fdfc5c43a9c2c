"""A vision-language model (mlx-vlm's classes) behind the call mlx-lm models answer.

The worker drives models as `model(tokens, cache=layer_caches)`; mlx-vlm's language
models take input embeddings and explicit position ids instead, and their vision tower
turns an image's pixels into one embedding per placeholder token. `VisionLanguageModel`
joins the two so every part of the worker (the probe, extend passes, decode steps) sees
the same kind of model:

- tokens above the vocabulary are images' pad values (common/image_keys.py): they are
  embedded as the model's image placeholder, then replaced by the image's features where
  the pass supplies them (`ImageFeatures`);
- positions are each row's cache offset plus its M-RoPE delta (`rope_deltas`), or the
  explicit (3, B, L) positions of a pass over image tokens (worker_mlx/mrope.py), so text
  rows and image rows share a batch.

Only families whose vision tower and positions are known here are served
(`SUPPORTED_TYPES`); any other mlx-vlm model is refused at load with one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache

from worker_mlx.model_probe import UnsupportedModel
from worker_mlx.mrope import ImageSpan

# mlx-vlm model types whose language model is Qwen2-VL's (M-RoPE over t, h, w sections)
SUPPORTED_TYPES = ("qwen2_5_vl", "qwen2_vl")


@dataclass
class ImageFeatures:
    """What a pass puts in place of its image tokens: `mask` (B, L) marks them, `values`
    (B, L, D) holds each one's vision-tower embedding (anything elsewhere)."""

    mask: mx.array
    values: mx.array


class VisionLanguageModel(nn.Module):
    """An mlx-vlm model called as an mlx-lm one (see the module's doc)."""

    def __init__(self, vlm: nn.Module, model_type: str):
        super().__init__()
        if model_type not in SUPPORTED_TYPES:
            raise UnsupportedModel(
                f"its vision tower ({model_type}) is not served; served: "
                + ", ".join(SUPPORTED_TYPES)
            )
        self.vlm = vlm
        config = vlm.config
        self.model_type = model_type
        self.image_token_id = int(config.image_token_id)
        self.vocab_size = int(config.text_config.vocab_size)
        self.merge = int(config.vision_config.spatial_merge_size)
        self.args = config.text_config  # what memory.py reads the model's widths from

    @property
    def layers(self):
        return self.vlm.language_model.model.layers

    def make_cache(self) -> list:
        return [KVCache() for _ in self.layers]

    def encode_image(self, pixel_values: mx.array, grid: tuple[int, int, int]) -> mx.array:
        """The vision tower's (placeholders, D) embeddings of one preprocessed image."""
        tower = self.vlm.vision_tower
        dtype = tower.patch_embed.proj.weight.dtype
        return tower(pixel_values.astype(dtype), mx.array([grid]), output_hidden_states=False)

    def span(self, start: int, grid: tuple[int, int, int]) -> ImageSpan:
        return ImageSpan(start, tuple(grid), self.merge)

    def __call__(
        self,
        inputs: mx.array,
        cache: list | None = None,
        positions: mx.array | None = None,
        rope_deltas: mx.array | None = None,
        images: ImageFeatures | None = None,
    ) -> mx.array:
        text = self.vlm.language_model
        real = mx.where(inputs >= self.vocab_size, self.image_token_id, inputs)
        h = text.model.embed_tokens(real)
        if images is not None:
            h = mx.where(images.mask[..., None], images.values.astype(h.dtype), h)
        if positions is None:
            positions = self._text_positions(inputs.shape, cache, rope_deltas)
        out = text.model(real, inputs_embeds=h, cache=cache, position_ids=positions)
        if text.args.tie_word_embeddings:
            return text.model.embed_tokens.as_linear(out)
        return text.lm_head(out)

    @staticmethod
    def _text_positions(shape, cache, rope_deltas) -> mx.array:
        """(3, B, L): each row's offset (plus its M-RoPE delta) and on, on all three axes."""
        B, L = shape
        offset = cache[0].offset if cache else 0
        start = mx.broadcast_to(mx.array(offset, dtype=mx.int32).reshape(-1, 1), (B, 1))
        if rope_deltas is not None:
            start = start + rope_deltas.reshape(B, 1).astype(mx.int32)
        return mx.broadcast_to((start + mx.arange(L, dtype=mx.int32))[None], (3, B, L))


def image_features(
    rows: list[list[tuple[int, mx.array]]], length: int, width: int
) -> ImageFeatures | None:
    """A pass's `ImageFeatures`: per row, (column, embeddings) of each run of image tokens
    it computes, the embeddings one per token from that column on."""
    if not any(rows):
        return None
    mask = np.zeros((len(rows), length), dtype=bool)
    values = []
    for b, runs in enumerate(rows):
        row = mx.zeros((length, width))
        for column, embeds in runs:
            n = embeds.shape[0]
            mask[b, column : column + n] = True
            row = mx.concatenate([row[:column], embeds.astype(row.dtype), row[column + n :]])
        values.append(row)
    return ImageFeatures(mx.array(mask), mx.stack(values))


def read_config(path: str) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def is_vision_model(path: str) -> bool:
    """Whether `path` is a local model directory whose config has a vision tower."""
    try:
        return "vision_config" in read_config(path)
    except (OSError, ValueError):
        return False


def load_vision_model(path: str) -> tuple[VisionLanguageModel, object]:
    """mlx-vlm's load of `path`, as a VisionLanguageModel, and its processor; a model whose
    vision tower is not served raises UnsupportedModel."""
    from mlx_vlm import load

    vlm, processor = load(path)
    return VisionLanguageModel(vlm, vlm.config.model_type), processor
