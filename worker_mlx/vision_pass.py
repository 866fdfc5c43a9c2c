"""What an extend pass of a vision model adds to its tokens: each row's M-RoPE positions
and the vision tower's embeddings of the image tokens it computes; and the RoPE delta a
request decodes with (none for a family without M-RoPE). The tower runs only for images
whose runs have tokens in the pass and whose outputs are not in `VisionPasses`'s cache (by
the image's digest, LRU, bounded in bytes), so a re-sent image whose KV was evicted skips
it; `tower_runs` and `cache_hits` count both outcomes (the worker reports them).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import mlx.core as mx
import numpy as np

from common.image_keys import pad_values
from common.messages import ExtendReq, ImagePart
from worker_mlx import mrope
from worker_mlx.vision_model import VisionLanguageModel, image_features

DEFAULT_CACHE_BYTES = 256 << 20


class VisionPasses:
    def __init__(self, model: VisionLanguageModel, cache_bytes: int = DEFAULT_CACHE_BYTES):
        self.model = model
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[bytes, mx.array] = OrderedDict()
        self.tower_runs = 0  # images the vision tower computed (the cache's misses)
        self.cache_hits = 0  # images whose tower output came from the cache

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
        if not self.model.mrope:
            return 0
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
            if self.model.mrope:
                positions[:, b, :n] = mrope.positions(start + n, spans)[0][:, start:]
            rows.append(self._runs(r, spans, start))
        extra = {"images": image_features(rows, L)}
        if self.model.mrope:
            extra["positions"] = mx.array(positions)
        return extra

    def _runs(self, r: ExtendReq, spans: list, start: int) -> list[tuple[int, mx.array]]:
        """(column, embeddings) of each image run's part among `r`'s new tokens, which
        must hold the image's pad values there and none elsewhere."""
        ids = np.array(r.input_ids)
        expected = np.full(len(ids), -1)
        runs = []
        for image, span in zip(r.images, spans):
            lo, hi = max(start, span.start), min(start + len(ids), span.start + span.length)
            if span.length != image.length:
                raise ValueError(f"{r.rid}: image at token {image.start} has a wrong length")
            if lo < hi:
                pads = pad_values(image.key, self.model.vocab_size, image.length)
                expected[lo - start : hi - start] = pads[lo - span.start : hi - span.start]
                embeds = self._embeddings(image, span, r.rid)
                runs.append((lo - start, embeds[lo - span.start : hi - span.start]))
        pads = ids >= self.model.vocab_size
        if not np.array_equal(np.where(pads, ids, -1), expected):
            raise ValueError(f"{r.rid}: image tokens do not match its images' runs")
        return runs

    def _embeddings(self, image: ImagePart, span: mrope.ImageSpan, rid: str) -> mx.array:
        cached = self._cache.get(image.key)
        if cached is not None:
            self._cache.move_to_end(image.key)
            self.cache_hits += 1
            return cached
        patches = int(np.prod(span.grid))
        pixels = np.frombuffer(image.pixels, dtype=np.float32)
        if not pixels.size or pixels.size % patches:
            raise ValueError(f"{rid}: image at token {image.start} has no pixel values")
        embeds = self.model.encode_image(pixels, span.grid)
        mx.eval(embeds)
        self.tower_runs += 1
        self._cache[image.key] = embeds
        while sum(e.nbytes for e in self._cache.values()) > self.cache_bytes:
            self._cache.popitem(last=False)
        return embeds
