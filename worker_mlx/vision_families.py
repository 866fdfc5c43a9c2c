"""What differs between the served vision families, on the worker's side: one small object
per family (`FAMILIES`, by mlx-vlm model type), so vision_model.py and vision_pass.py hold
no per-family branches. The router's side (the image's text and grid) is
common/vision_layout.py.

Each family says:

- `mrope`: whether its language model takes Qwen-VL's (3, B, L) multimodal positions
  (worker_mlx/mrope.py) or plain offsets;
- `merge`: the spatial merge of its image grid (a run has prod(grid) / merge**2 tokens);
- `make_cache()`: its layers' mlx-lm caches (the worker's probe reads their kinds: a
  sliding-window layer is a RotatingKVCache);
- `encode(pixels, grid)`: the vision tower's (run length, W) output for one image, as the
  tower cache keeps it (W may be wider than the language model: Qwen3-VL's deepstack
  features ride along);
- `merged(values)`: the part of those values that replaces the placeholder embeddings;
- `run(...)`: the language model's hidden states, as mlx-vlm's own forward computes them.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache


class QwenVL:
    """Qwen2-VL and Qwen2.5-VL: a ViT whose merger outputs the language model's width, and
    an M-RoPE language model."""

    mrope = True

    def __init__(self, vlm: nn.Module):
        config = vlm.config
        self.vlm, self.text = vlm, vlm.language_model
        self.image_token_id = int(config.image_token_id)
        self.merge = int(config.vision_config.spatial_merge_size)
        self.width = int(config.text_config.hidden_size)

    def make_cache(self) -> list:
        return [KVCache() for _ in self.text.model.layers]

    def _tower(self, pixels: np.ndarray, grid: tuple[int, int, int]):
        tower = self.vlm.vision_tower
        dtype = tower.patch_embed.proj.weight.dtype
        patches = mx.array(pixels.reshape(int(np.prod(grid)), -1)).astype(dtype)
        return tower, patches, mx.array([grid])

    def encode(self, pixels: np.ndarray, grid: tuple[int, int, int]) -> mx.array:
        tower, patches, grids = self._tower(pixels, grid)
        return tower(patches, grids, output_hidden_states=False)

    def merged(self, values: mx.array) -> mx.array:
        return values

    def run(self, real, h, cache, positions, images) -> mx.array:
        return self.text.model(real, inputs_embeds=h, cache=cache, position_ids=positions)


class Qwen3VL(QwenVL):
    """Qwen3-VL: its tower also gives *deepstack* features, one set per early language
    layer, which mlx-vlm adds to those layers' hidden states at the image's positions; they
    are kept next to the merged features, (run, width * (1 + layers))."""

    def encode(self, pixels: np.ndarray, grid: tuple[int, int, int]) -> mx.array:
        tower, patches, grids = self._tower(pixels, grid)
        features, deepstack = tower(patches, grids)
        return mx.concatenate([features, *deepstack], axis=-1)

    def merged(self, values: mx.array) -> mx.array:
        return values[..., : self.width]

    def run(self, real, h, cache, positions, images) -> mx.array:
        deepstack = mask = None
        if images is not None:
            # mlx-vlm's layout: the (B, L) mask, and per layer the marked tokens' features
            # in batch-major order
            mask = images.mask
            at = mx.array(np.flatnonzero(np.array(mask).reshape(-1)), dtype=mx.uint32)
            flat = images.values.reshape(-1, images.values.shape[-1])[at]
            layers = flat.shape[-1] // self.width - 1
            deepstack = [
                flat[:, self.width * (i + 1) : self.width * (i + 2)] for i in range(layers)
            ]
        return self.text.model(
            real, inputs_embeds=h, cache=cache, position_ids=positions,
            visual_pos_masks=mask, deepstack_visual_embeds=deepstack,
        )  # fmt: skip


class Gemma3:
    """Gemma 3: a SigLIP tower over the fixed-size image, average-pooled and projected to
    the soft tokens, which mlx-vlm divides by sqrt(hidden) (the text model multiplies every
    embedding by it); plain 1-D RoPE; local sliding-window and global layers."""

    mrope = False
    merge = 1

    def __init__(self, vlm: nn.Module):
        config = vlm.config
        self.vlm, self.text = vlm, vlm.language_model
        self.image_token_id = int(config.image_token_index)
        self.width = int(config.text_config.hidden_size)
        self.size = int(config.vision_config.image_size)
        self.scale = float(config.hidden_size) ** 0.5  # as mlx-vlm's (the top-level key)

    def make_cache(self) -> list:
        """As mlx-vlm's: layer i is global when (i + 1) % pattern == 0, else windowed."""
        config = self.text.config
        pattern, window = int(config.sliding_window_pattern), int(config.sliding_window)
        return [
            KVCache() if (i + 1) % pattern == 0 else RotatingKVCache(max_size=window, keep=0)
            for i in range(len(self.text.model.layers))
        ]

    def encode(self, pixels: np.ndarray, grid: tuple[int, int, int]) -> mx.array:
        dtype = self.text.model.embed_tokens.weight.dtype
        image = mx.array(pixels.reshape(1, 3, self.size, self.size)).transpose(0, 2, 3, 1)
        hidden, _, _ = self.vlm.vision_tower(image.astype(dtype), output_hidden_states=True)
        features = self.vlm.multi_modal_projector(hidden)[0]
        assert features.shape[0] == math.prod(grid)
        return features / self.scale

    def merged(self, values: mx.array) -> mx.array:
        return values

    def run(self, real, h, cache, positions, images) -> mx.array:
        return self.text.model(real, inputs_embeds=h, cache=cache)


FAMILIES = {"qwen2_vl": QwenVL, "qwen2_5_vl": QwenVL, "qwen3_vl": Qwen3VL, "gemma3": Gemma3}
