"""A vision model's images in chat requests: from content parts to the worker's inputs.

OpenAI's `image_url` parts (and Anthropic's `image` blocks and the Responses API's
`input_image` parts, converted to them) are taken out of the chat before it is rendered:
each becomes the text the model's template writes for one image (its family's
`ImageLayout`, common/vision_layout.py: Qwen-VL's `<|vision_start|><|image_pad|>
<|vision_end|>`, Gemma 3's `<start_of_image>`), and its bytes are read (a `data:` URL, a
`file:` URL, an `http(s)` URL only with --allow-image-urls), decoded and preprocessed with
the model's own image processor (mlx-vlm's, torch-free) in a thread, off the event loop;
the same bytes again (every turn of a conversation resends its images) take the last
result from an LRU by digest (256 MiB) instead. After tokenization each image's one
placeholder token becomes its run: as many tokens as the processor's grid gives, the
image's pad values (common/image_keys.py), so the radix cache keys on its identity;
`PromptIds.images` carries the pixels, grids, run lengths and digests to the scheduler
and worker.

Every refusal is a 400 naming the part: over --max-images-per-request or
--max-image-bytes (a base64 payload is measured before it is decoded), bytes that are
not an image, a format not served, a URL kind not allowed, a decompression bomb.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import numpy as np

from common.image_keys import image_hash, pad_values
from common.messages import ImagePart
from common.vision_layout import ImageLayout, image_layout
from router.request_error import RequestError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
URL_TIMEOUT = 10.0
MAX_PIXELS = 64 * 1024 * 1024  # decoded pixels of one image (PIL's bomb check at 2x)
PREPARED_CACHE_BYTES = 256 << 20


class PromptIds(list):
    """A prompt's token ids and the images whose runs of pad values they hold."""

    def __init__(self, ids: list[int], images: list[ImagePart]):
        super().__init__(ids)
        self.images = images


@dataclass
class Limits:
    max_bytes: int
    max_images: int
    allow_urls: bool


@dataclass
class Prepared:
    where: str
    digest: bytes
    pixels: np.ndarray  # (patches, features) float32
    grid: list[int]


class VisionInputs:
    """The served vision model's image handling (`of` a model directory: None for a
    model without a vision tower, whose image parts the chat's checks refuse)."""

    def __init__(self, layout: ImageLayout, processor, tokenizer, limits: Limits):
        self.layout = layout
        self.processor = processor
        self.tokenizer = tokenizer
        self.image_text = layout.image_text(tokenizer)
        self.limits = limits
        # preprocessed images by digest, LRU, bounded in bytes (`_prepare`; threads fill it)
        self._prepared: OrderedDict[bytes, Prepared] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def expand_text(self, prompt: str) -> str:
        """The rendered prompt as the model's processor rewrites it before tokenizing."""
        return self.layout.expand_text(self.tokenizer, prompt)

    @classmethod
    def of(cls, model_path: str, tokenizer, limits: Limits) -> VisionInputs | None:
        try:
            config = json.loads((Path(model_path) / "config.json").read_text())
        except (OSError, ValueError):
            return None
        layout = image_layout(config)
        if layout is None:
            return None
        from mlx_vlm.utils import get_model_and_args, load_processor

        get_model_and_args(config)  # imports the family's module: its processor's registration
        processor = load_processor(model_path, add_detokenizer=False).image_processor
        return cls(layout, processor, tokenizer, limits)

    async def take(self, messages: list) -> tuple[list, list[Prepared]]:
        """The chat with each image part replaced by the model's image text, and the
        images, read and preprocessed, in prompt order."""
        out, found = [], []
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, list):
                out.append(message)
                continue
            parts = []
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "image_url":
                    found.append((part.pop("_where", f"messages[{i}].content[{j}]"), part))
                    part = {"type": "text", "text": self.image_text}
                parts.append(part)
            out.append({**message, "content": parts})
        if len(found) > self.limits.max_images:
            raise RequestError(
                f"{len(found)} images, more than --max-images-per-request "
                f"({self.limits.max_images})",
                param=found[self.limits.max_images][0],
            )
        raw = [(where, await self._bytes(where, part)) for where, part in found]
        return out, await asyncio.to_thread(lambda: [self._prepare(w, b) for w, b in raw])

    def expand(self, ids: list[int], images: list[Prepared]) -> PromptIds | list[int]:
        """The rendered prompt's ids with each image's placeholder expanded to its run of
        pad values."""
        if not images:
            return ids
        at = [k for k, t in enumerate(ids) if t == self.layout.image_token_id]
        if len(at) != len(images):
            raise RequestError(
                f"the prompt holds {len(at)} image placeholders for {len(images)} images"
            )
        out, parts, last = [], [], 0
        for k, image in zip(at, images):
            out += ids[last:k]
            n = self.layout.run_length(image.grid)
            pads = pad_values(image.digest, self.layout.vocab_size, n)
            parts.append(ImagePart(len(out), image.grid, n, image.digest, image.pixels.tobytes()))
            out += pads
            last = k + 1
        return PromptIds(out + ids[last:], parts)

    async def _bytes(self, where: str, part: dict) -> bytes:
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise RequestError(f"{where}: an image_url part needs a string url", param=where)
        if url.startswith("data:"):
            return self._data_url(where, url)
        parsed = urlparse(url)
        if parsed.scheme == "file":
            return self._file(where, Path(unquote(parsed.path)))
        if parsed.scheme in ("http", "https"):
            if not self.limits.allow_urls:
                raise RequestError(
                    f"{where}: image URLs are not fetched (start the server with "
                    "--allow-image-urls); send the image as a data: URL",
                    param=where,
                )
            return await self._fetch(where, url)
        raise RequestError(f"{where}: an image URL must be data:, file: or http(s)", param=where)

    def _too_big(self, where: str, size: int) -> RequestError:
        return RequestError(
            f"{where}: the image has {size} bytes, more than --max-image-bytes "
            f"({self.limits.max_bytes})",
            param=where,
        )

    def _data_url(self, where: str, url: str) -> bytes:
        head, _, payload = url.partition(",")
        if not head.endswith(";base64"):
            raise RequestError(f"{where}: a data: URL image must be base64", param=where)
        if len(payload) * 3 // 4 > self.limits.max_bytes + 2:  # measured before decoding
            raise self._too_big(where, len(payload) * 3 // 4)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(
                f"{where}: the image's base64 does not decode", param=where
            ) from None

    def _file(self, where: str, path: Path) -> bytes:
        try:
            size = path.stat().st_size
            if size > self.limits.max_bytes:
                raise self._too_big(where, size)
            return path.read_bytes()
        except OSError as exc:
            raise RequestError(
                f"{where}: cannot read {path}: {exc.strerror}", param=where
            ) from None

    async def _fetch(self, where: str, url: str) -> bytes:
        import httpx

        data = bytearray()
        try:
            async with httpx.AsyncClient(timeout=URL_TIMEOUT) as client:
                async with client.stream("GET", url, follow_redirects=True) as response:
                    response.raise_for_status()
                    async for chunk in response.aiter_bytes():
                        data += chunk
                        if len(data) > self.limits.max_bytes:
                            raise self._too_big(where, len(data))
        except httpx.HTTPError as exc:
            raise RequestError(f"{where}: cannot fetch the image: {exc}", param=where) from None
        return bytes(data)

    def _prepare(self, where: str, data: bytes) -> Prepared:
        """One image's grid and pixels: the processor's, or the last ones of the same bytes
        (a conversation sends its images again every turn; decoding and preprocessing them
        would cost the turn what its cached KV saved)."""
        digest = image_hash(data)
        with self._lock:
            hit = self._prepared.get(digest)
            if hit is not None:
                self._prepared.move_to_end(digest)
                return Prepared(where, digest, hit.pixels, hit.grid)
        prepared = self._preprocess(where, data, digest)
        with self._lock:
            self._prepared[digest] = prepared
            self._held += prepared.pixels.nbytes
            while self._held > PREPARED_CACHE_BYTES:
                self._held -= self._prepared.popitem(last=False)[1].pixels.nbytes
        return prepared

    def _preprocess(self, where: str, data: bytes, digest: bytes) -> Prepared:
        """Decode (PIL) and preprocess (the model's processor) one image."""
        from PIL import Image

        try:
            image = Image.open(io.BytesIO(data))
            if image.format not in FORMATS:
                raise RequestError(
                    f"{where}: {image.format} images are not served; send one of "
                    + ", ".join(FORMATS),
                    param=where,
                )
            if image.width * image.height > MAX_PIXELS:
                raise RequestError(
                    f"{where}: the image has {image.width}x{image.height} pixels, more than "
                    f"{MAX_PIXELS}",
                    param=where,
                )
            image = image.convert("RGB")
        except (OSError, ValueError, Image.DecompressionBombError) as exc:
            raise RequestError(
                f"{where}: the bytes are not an image ({exc})", param=where
            ) from None
        ((grid, pixels),) = self.layout.per_image(self.processor(images=[image]))
        return Prepared(where, digest, pixels, grid)
