"""The router's side of images on each served family: the chat's image part becomes the
family's image text, the prompt's placeholder its run of pad values (as mlx-vlm's
processor writes the prompt, token for token apart from the pads), and the same bytes are
preprocessed once."""

from __future__ import annotations

import asyncio
import base64

import pytest

from common.image_keys import image_hash, pad_values
from common.tiny_vlm import VLM_FAMILIES, ensure_tiny_vlm
from router.api.image_inputs import Limits, VisionInputs
from tests.conftest import load_vlm, random_image
from tests.vision_prompts import png


@pytest.fixture(scope="module", params=VLM_FAMILIES)
def family(request, model_cache):
    path = str(ensure_tiny_vlm(model_cache, arch=request.param))
    _, processor = load_vlm(path)
    tok = processor.tokenizer
    return path, processor, VisionInputs.of(path, tok, Limits(1 << 20, 4, False))


class Counting:
    """The real image processor, its calls counted."""

    def __init__(self, processor):
        self.processor, self.calls = processor, 0

    def __call__(self, **kwargs):
        self.calls += 1
        return self.processor(**kwargs)


def _chat(image) -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(png(image)).decode()
    parts = [{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": url}}]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": " What is it?"}]}]


def test_prompt_ids_are_the_processors_with_pad_values(family):
    path, processor, vision = family
    picture = random_image(50)
    messages, images = asyncio.run(vision.take(_chat(picture)))
    tok = processor.tokenizer
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = vision.expand(tok.encode(vision.expand_text(rendered), add_special_tokens=False), images)
    # mlx-vlm's own: the template's image part, the processor's expansion
    ref_chat = [{"role": "user", "content": [{"type": "text", "text": "Look: "},
                {"type": "image"}, {"type": "text", "text": " What is it?"}]}]  # fmt: skip
    prompt = tok.apply_chat_template(ref_chat, tokenize=False, add_generation_prompt=True)
    want = processor(images=[picture], text=[prompt], return_tensors="np")["input_ids"][0]
    (image,) = ids.images
    run = range(image.start, image.start + image.length)
    assert [t for k, t in enumerate(ids) if k not in run] == [
        t for k, t in enumerate(want.tolist()) if k not in run
    ]
    assert ids[image.start : image.start + image.length] == pad_values(
        image_hash(png(picture)), vision.layout.vocab_size, image.length
    )
    assert all(want[k] == vision.layout.image_token_id for k in run)


def test_the_same_image_is_preprocessed_once(family):
    _, _, vision = family
    counting = vision.processor = Counting(vision.processor)
    picture, other = random_image(51), random_image(52)
    first = asyncio.run(vision.take(_chat(picture)))[1][0]
    again = asyncio.run(vision.take(_chat(picture)))[1][0]
    assert counting.calls == 1
    assert again.grid == first.grid and (again.pixels == first.pixels).all()
    asyncio.run(vision.take(_chat(other)))
    assert counting.calls == 2
