"""Qwen-VL's multimodal RoPE positions for a prompt, exactly as mlx-vlm's `get_rope_index`.

Every text token gets one position on all three axes (t, h, w), the next after the last;
an image's run of `t * (h/m) * (w/m)` placeholders (grid of patches `h x w`, merged `m x m`)
gets the grid coordinates of each merged patch, each offset by the position the run starts
at, and the text after it continues from the largest of them plus one. So after the images
a row's position is its token index plus a *delta* (negative: an image takes fewer
positions than tokens), which decode steps add to each row's offset.

The worker knows only a request's new tokens and where the prompt's images are
(`ImageSpan`), not the prompt before them; the positions of any token range follow from
those spans alone, so a chunk or a cached prefix may end anywhere, inside an image too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ImageSpan:
    """An image's placeholder run in a prompt: its first token's index and its patch grid."""

    start: int
    grid: tuple[int, int, int]  # (t, h, w) in patches, as the processor's image_grid_thw
    merge: int  # the vision tower's spatial merge size

    @property
    def shape(self) -> tuple[int, int, int]:
        t, h, w = self.grid
        return t, h // self.merge, w // self.merge

    @property
    def length(self) -> int:
        t, h, w = self.shape
        return t * h * w

    def positions(self, first: int) -> np.ndarray:
        """(3, length): each merged patch's (t, h, w) coordinates plus `first`."""
        t, h, w = self.shape
        grid = np.indices((t, h, w)).reshape(3, -1)
        return grid + first


def positions(n_tokens: int, spans: list[ImageSpan]) -> tuple[np.ndarray, int]:
    """(3, n_tokens) positions of a prompt's first `n_tokens` with these image runs (the
    runs may go on past them), and the delta after them (the next position minus
    `n_tokens`, where they end after a text token or a whole run)."""
    total = max([n_tokens] + [s.start + s.length for s in spans])
    out = np.empty((3, total), dtype=np.int64)
    token, pos = 0, 0
    for span in sorted(spans, key=lambda s: s.start):
        text = span.start - token
        out[:, token : span.start] = pos + np.arange(text)
        image = span.positions(pos + text)
        out[:, span.start : span.start + span.length] = image
        token, pos = span.start + span.length, int(image.max()) + 1
    out[:, token:] = pos + np.arange(total - token)
    return out[:, :n_tokens], pos + (total - token) - total
