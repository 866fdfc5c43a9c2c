"""A vision-language model (mlx-vlm's classes) behind the call mlx-lm models answer.

The worker drives models as `model(tokens, cache=layer_caches)`; mlx-vlm's language
models take input embeddings and explicit position ids instead, and their vision tower
turns an image's pixels into one embedding per placeholder token. `VisionLanguageModel`
joins the two so every part of the worker (the probe, extend passes, decode steps) sees
the same kind of model:

- tokens above the vocabulary are images' pad values (common/image_keys.py): they are
  embedded as the model's image placeholder, then replaced by the image's features where
  the pass supplies them (`ImageFeatures`);
- an M-RoPE family's positions are each row's cache offset plus its M-RoPE delta
  (`rope_deltas`), or the explicit (3, B, L) positions of a pass over image tokens
  (worker_mlx/mrope.py), so text rows and image rows share a batch; other families'
  follow the offsets.

What differs between families is one object each (worker_mlx/vision_families.py). Only
the families there are served (`SUPPORTED_TYPES`); any other mlx-vlm model is refused at
load with one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from worker_mlx.model_probe import UnsupportedModel
from worker_mlx.mrope import ImageSpan
from worker_mlx.vision_families import FAMILIES

SUPPORTED_TYPES = tuple(FAMILIES)  # mlx-vlm model types


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
        self.family = FAMILIES[model_type](vlm)
        self.model_type = model_type
        self.image_token_id = self.family.image_token_id
        self.vocab_size = int(vlm.config.text_config.vocab_size)
        self.merge = self.family.merge
        self.mrope = self.family.mrope
        self.args = vlm.config.text_config  # what memory.py reads the model's widths from

    @property
    def layers(self):
        return self.vlm.language_model.model.layers

    def make_cache(self) -> list:
        return self.family.make_cache()

    def encode_image(self, pixels: np.ndarray, grid: tuple[int, int, int]) -> mx.array:
        """The vision tower's (placeholders, W) output for one preprocessed image (float32
        pixel values as the processor gave them), as the tower cache keeps it."""
        return self.family.encode(np.asarray(pixels, dtype=np.float32), tuple(grid))

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
            merged = self.family.merged(images.values)
            h = mx.where(images.mask[..., None], merged.astype(h.dtype), h)
        if positions is None and self.mrope:
            positions = self._text_positions(inputs.shape, cache, rope_deltas)
        out = self.family.run(real, h, cache, positions, images)
        head = getattr(text, "lm_head", None)  # absent where tied to the embeddings
        return head(out) if head is not None else text.model.embed_tokens.as_linear(out)

    @staticmethod
    def _text_positions(shape, cache, rope_deltas) -> mx.array:
        """(3, B, L): each row's offset (plus its M-RoPE delta) and on, on all three axes."""
        B, L = shape
        offset = cache[0].offset if cache else 0
        start = mx.broadcast_to(mx.array(offset, dtype=mx.int32).reshape(-1, 1), (B, 1))
        if rope_deltas is not None:
            start = start + rope_deltas.reshape(B, 1).astype(mx.int32)
        return mx.broadcast_to((start + mx.arange(L, dtype=mx.int32))[None], (3, B, L))


def image_features(rows: list[list[tuple[int, mx.array]]], length: int) -> ImageFeatures | None:
    """A pass's `ImageFeatures`: per row, (column, embeddings) of each run of image tokens
    it computes, the embeddings one per token from that column on."""
    if not any(rows):
        return None
    width = next(e for runs in rows for _, e in runs).shape[-1]
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
