"""How a served vision family lays an image out in the prompt, read from its config.json:
the router's side of a vision model (the worker's is worker_mlx/vision_families.py).

For each family (`LAYOUTS`, by mlx-vlm model type): the placeholder token the processor
expands, the text the chat template writes for one image (holding one placeholder once
the prompt is rewritten as the family's processor does, `expand_text`), and how
the image processor's output becomes each image's patch grid and pixels. An image's run
of placeholders has `prod(grid) // merge**2` tokens:

- Qwen2-VL, Qwen2.5-VL, Qwen3-VL: `<|vision_start|><|image_pad|><|vision_end|>`; the grid
  is the processor's `image_grid_thw` (patches), merged `merge x merge`;
- Gemma 3: `<start_of_image>`, as its template writes an image part, which the rendered
  prompt then has replaced by `\\n\\n<start_of_image><image_soft_token><end_of_image>\\n\\n`
  before tokenizing (`expand_text`, what its processor does); the grid is the pooled soft
  tokens, `1 x s x s` with `s * s = mm_tokens_per_image`, unmerged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ImageLayout:
    model_type: str
    image_token_id: int
    vocab_size: int  # the language model's: every pad value is at least this
    merge: int
    run_ids: tuple[int, ...]  # the template's image text, as tokens (one placeholder)

    def image_text(self, tokenizer) -> str:
        raise NotImplementedError

    def expand_text(self, tokenizer, prompt: str) -> str:
        """The rendered prompt as the family's processor rewrites it before tokenizing."""
        return prompt

    def per_image(self, out: dict) -> list[tuple[list[int], np.ndarray]]:
        """(grid, float32 pixels) of each image in the image processor's output `out`."""
        raise NotImplementedError

    def run_length(self, grid: list[int]) -> int:
        return int(np.prod(grid)) // self.merge**2


def _text(config: dict) -> dict:
    return config.get("text_config") or config


def _vocab(config: dict) -> int:
    """The language model's vocabulary as mlx-vlm reads it (its TextConfig, defaults
    included: Gemma 3 checkpoints may leave it out), which is what the worker's embedding
    has and its pad-value checks use."""
    from mlx_vlm.utils import get_model_and_args

    arch, _ = get_model_and_args(config)
    return int(arch.TextConfig.from_dict(_text(config)).vocab_size)


class QwenVLLayout(ImageLayout):
    @classmethod
    def of(cls, config: dict) -> QwenVLLayout:
        image = int(config["image_token_id"])
        return cls(
            config["model_type"],
            image,
            _vocab(config),
            int(config["vision_config"].get("spatial_merge_size", 2)),
            (config["vision_start_token_id"], image, config["vision_end_token_id"]),
        )

    def image_text(self, tokenizer) -> str:
        return tokenizer.decode(list(self.run_ids))

    def per_image(self, out: dict) -> list[tuple[list[int], np.ndarray]]:
        grids = [[int(x) for x in g] for g in np.asarray(out["image_grid_thw"])]
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        bounds = np.cumsum([0] + [int(np.prod(g)) for g in grids])
        return [(g, pixels[a:b]) for g, a, b in zip(grids, bounds, bounds[1:])]


@dataclass(frozen=True)
class Gemma3Layout(ImageLayout):
    tokens_per_image: int = 256

    @classmethod
    def of(cls, config: dict) -> Gemma3Layout:
        text = _text(config)
        image = int(config["image_token_index"])
        run = (config["boi_token_index"], image, config["eoi_token_index"])
        tokens = int(text.get("mm_tokens_per_image", config.get("mm_tokens_per_image", 256)))
        return cls("gemma3", image, _vocab(config), 1, run, tokens)

    @property
    def side(self) -> int:
        """Soft tokens per side of the pooled image."""
        return int(round(self.tokens_per_image**0.5))

    def image_text(self, tokenizer) -> str:
        """The begin-of-image marker, as Gemma 3's template writes an image part (and which
        its `trim` of text parts keeps); `expand_text` then writes the image's text."""
        return tokenizer.decode([self.run_ids[0]])

    def expand_text(self, tokenizer, prompt: str) -> str:
        """As mlx-vlm's Gemma3Processor: every begin-of-image marker becomes
        `\n\n<start_of_image><image_soft_token><end_of_image>\n\n` (one placeholder here,
        which the router then expands to the run)."""
        boi, image, eoi = (tokenizer.decode([t]) for t in self.run_ids)
        return prompt.replace(boi, f"\n\n{boi}{image}{eoi}\n\n")

    def per_image(self, out: dict) -> list[tuple[list[int], np.ndarray]]:
        pixels = [np.asarray(p, dtype=np.float32) for p in out["pixel_values"]]
        return [([1, self.side, self.side], p.reshape(self.side**2, -1)) for p in pixels]


LAYOUTS = {
    "qwen2_vl": QwenVLLayout,
    "qwen2_5_vl": QwenVLLayout,
    "qwen3_vl": QwenVLLayout,
    "gemma3": Gemma3Layout,
}
SERVED_TYPES = tuple(LAYOUTS)


def image_layout(config: dict) -> ImageLayout | None:
    """The layout of a served vision model's config (None: no vision tower, or one not
    served)."""
    kind = LAYOUTS.get(config.get("model_type")) if "vision_config" in config else None
    return kind.of(config) if kind else None
