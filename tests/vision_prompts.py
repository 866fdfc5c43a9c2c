"""Chats with images as the router sends them, for the vision tests: token ids whose image
runs are the images' pad values, the runs' spans, the pixels and the embeddings."""

from __future__ import annotations

import io

import numpy as np

from common.image_keys import image_hash, pad_values
from common.messages import ImagePart
from common.vision_layout import image_layout
from worker_mlx.vision_model import VisionLanguageModel, read_config


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
    images' pad values, the spans of those runs, and each image's vision-tower output."""

    def __init__(self, model: VisionLanguageModel, processor, messages, images):
        prompt = processor.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        inputs = processor(images=images or None, text=[prompt], return_tensors="np")
        ids = np.array(inputs["input_ids"]).reshape(-1)
        self.real_ids = ids.tolist()
        layout = image_layout(read_config(processor.tokenizer.name_or_path))
        per_image = layout.per_image(inputs) if images else []
        runs = np.flatnonzero(np.diff(np.r_[0, ids == model.image_token_id, 0]))
        starts = runs[0::2].tolist()
        self.spans = [model.span(s, g) for s, (g, _) in zip(starts, per_image)]
        self.ids, self.embeds, self.parts = list(self.real_ids), [], []
        for span, image, (_, pixels) in zip(self.spans, images, per_image):
            key = image_hash(png(image))
            self.ids[span.start : span.start + span.length] = pad_values(
                key, model.vocab_size, span.length
            )
            self.embeds.append(model.encode_image(pixels, span.grid))
            self.parts.append(
                ImagePart(span.start, list(span.grid), span.length, key, pixels.tobytes())
            )
