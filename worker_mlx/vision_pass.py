"""What an extend pass of a vision model adds to its tokens: each row's M-RoPE positions
and the vision tower's embeddings of the image tokens it computes; and the RoPE delta a
request decodes with. The tower runs only for images whose runs have tokens in the pass
and whose embeddings are not in `VisionPasses`'s cache (by pad value, LRU, bounded in
bytes), so a re-sent image whose KV was evicted skips it.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import mlx.core as mx
import numpy as np

from common.messages import ExtendReq, ImagePart
from worker_mlx import mrope
from worker_mlx.vision_model import VisionLanguageModel, image_features

DEFAULT_CACHE_BYTES = 256 << 20


class VisionPasses:
    def __init__(self, model: VisionLanguageModel, cache_bytes: int = DEFAULT_CACHE_BYTES):
        self.model = model
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[int, mx.array] = OrderedDict()
        self.tower_runs = 0  # images the vision tower computed (the cache's misses)

    def _spans(self, r: ExtendReq) -> list[mrope.ImageSpan]:
        return [self.model.span(im.start, tuple(im.grid)) for im in r.images]

    def real_ids(self, r: ExtendReq) -> ExtendReq:
        """`r` with its images' pad values as the model's placeholder id, as sampling
        penalties see the prompt (mlx-vlm's see the placeholders); pad values would index
        past the logits."""
        if not r.images or not r.sampling.penalized:
            return r
        vocab, placeholder = self.model.vocab_size, self.model.image_token_id

        def real(ids: list[int]) -> list[int]:
            return [placeholder if t >= vocab else t for t in ids]

        return dataclasses.replace(r, input_ids=real(r.input_ids), context_ids=real(r.context_ids))

    def rope_skip(self, r: ExtendReq) -> int:
        """Positions `r`'s prompt skips (minus its M-RoPE delta): a decode step's position
        is its token index less this, as a speculative hole's column is skipped."""
        n = len(r.prefix_slot_ids) + len(r.input_ids)
        return -mrope.positions(n, self._spans(r))[1]

    def inputs(self, reqs: list[ExtendReq], L: int) -> dict:
        """The model's keyword arguments for a pass over `reqs` right-padded to L: none
        when no row's prompt has an image (positions follow the offsets)."""
        if not any(r.images for r in reqs):
            return {}
        positions = np.zeros((3, len(reqs), L), dtype=np.int32)
        rows = []
        for b, r in enumerate(reqs):
            start, n = len(r.prefix_slot_ids), len(r.input_ids)
            spans = self._spans(r)
            positions[:, b, :n] = mrope.positions(start + n, spans)[0][:, start:]
            rows.append(self._runs(r, spans, start))
        width = self.model.args.hidden_size
        return {"positions": mx.array(positions), "images": image_features(rows, L, width)}

    def _runs(self, r: ExtendReq, spans: list, start: int) -> list[tuple[int, mx.array]]:
        """(column, embeddings) of each image run's part among `r`'s new tokens, which
        must hold the image's pad value there and nowhere else."""
        ids = np.array(r.input_ids)
        expected = np.full(len(ids), -1)
        runs = []
        for image, span in zip(r.images, spans):
            lo, hi = max(start, span.start), min(start + len(ids), span.start + span.length)
            if lo < hi:
                expected[lo - start : hi - start] = image.pad
                embeds = self._embeddings(image, span, r.rid)
                runs.append((lo - start, embeds[lo - span.start : hi - span.start]))
        pads = ids >= self.model.vocab_size
        if not np.array_equal(np.where(pads, ids, -1), expected):
            raise ValueError(f"{r.rid}: image tokens do not match its images' runs")
        return runs

    def _embeddings(self, image: ImagePart, span: mrope.ImageSpan, rid: str) -> mx.array:
        cached = self._cache.get(image.pad)
        if cached is not None:
            self._cache.move_to_end(image.pad)
            return cached
        patches = int(np.prod(span.grid))
        pixels = np.frombuffer(image.pixels, dtype=np.float32)
        if not pixels.size or pixels.size % patches:
            raise ValueError(f"{rid}: image at token {image.start} has no pixel values")
        embeds = self.model.encode_image(mx.array(pixels.reshape(patches, -1)), span.grid)
        mx.eval(embeds)
        self.tower_runs += 1
        self._cache[image.pad] = embeds
        while sum(e.nbytes for e in self._cache.values()) > self.cache_bytes:
            self._cache.popitem(last=False)
        return embeds
