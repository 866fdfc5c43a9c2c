"""Chats with images as the router sends them, for the vision tests: token ids whose image
runs are the images' pad values, the runs' spans, the pixels and the embeddings."""

from __future__ import annotations

import io

import mlx.core as mx
import numpy as np

from common.image_keys import image_hash, pad_value
from common.messages import ImagePart
from worker_mlx.vision_model import VisionLanguageModel


def png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def chat(*content) -> list[dict]:
    return [{"role": "user", "content": list(content)}]


IMAGE = {"type": "image"}


def text(s: str) -> dict:
    return {"type": "text", "text": s}


class Prompt:
    """A chat with images as the router would send it: token ids whose image runs are the
    images' pad values, the spans of those runs, and each image's vision embeddings."""

    def __init__(self, model: VisionLanguageModel, processor, messages, images):
        prompt = processor.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        inputs = processor(images=images or None, text=[prompt], return_tensors="np")
        ids = np.array(inputs["input_ids"]).reshape(-1)
        self.real_ids = ids.tolist()
        grids = np.array(inputs["image_grid_thw"]).tolist() if images else []
        runs = np.flatnonzero(np.diff(np.r_[0, ids == model.image_token_id, 0]))
        starts = runs[0::2].tolist()
        self.spans = [model.span(s, g) for s, g in zip(starts, grids)]
        pixels = np.array(inputs["pixel_values"]) if images else None
        self.ids, self.embeds, self.parts, first = list(self.real_ids), [], [], 0
        for span, image in zip(self.spans, images):
            pad = pad_value(image_hash(png(image)), model.vocab_size)
            self.ids[span.start : span.start + span.length] = [pad] * span.length
            patches = pixels[first : first + int(np.prod(span.grid))].astype(np.float32)
            self.embeds.append(model.encode_image(mx.array(patches), span.grid))
            self.parts.append(ImagePart(span.start, list(span.grid), pad, patches.tobytes()))
            first += len(patches)
