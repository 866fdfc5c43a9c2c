"""The worker's view of a vision-language model: pad values in the token sequence, the
vision tower's embeddings merged at their positions, Qwen-VL's M-RoPE positions computed
from the image spans alone, prefill cut anywhere (inside an image too) and decode with the
row's RoPE delta, token for token as mlx-vlm's own greedy generation."""

from __future__ import annotations

import io

import mlx.core as mx
import numpy as np
import pytest

from common.image_keys import image_hash, pad_value
from tests.conftest import load_vlm, random_image, vlm_greedy
from worker_mlx import mrope
from worker_mlx.model_probe import UnsupportedModel
from worker_mlx.vision_model import VisionLanguageModel, image_features


def _png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _chat(*content) -> list[dict]:
    return [{"role": "user", "content": list(content)}]


IMAGE = {"type": "image"}


def _text(s: str) -> dict:
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
        self.ids, self.embeds, first = list(self.real_ids), [], 0
        for span, image in zip(self.spans, images):
            pad = pad_value(image_hash(_png(image)), model.vocab_size)
            self.ids[span.start : span.start + span.length] = [pad] * span.length
            patches = int(np.prod(span.grid))
            self.embeds.append(
                model.encode_image(mx.array(pixels[first : first + patches]), span.grid)
            )
            first += patches


def _run(model: VisionLanguageModel, prompt: Prompt, cuts: list[int], max_tokens: int):
    """Prefill in pieces ending at `cuts`, then greedy decode: the tokens."""
    cache = model.make_cache()
    pos, delta = mrope.positions(len(prompt.ids), prompt.spans)
    bounds = [0, *cuts, len(prompt.ids)]
    width = model.args.hidden_size
    for a, b in zip(bounds, bounds[1:]):
        runs = []
        for span, embeds in zip(prompt.spans, prompt.embeds):
            lo, hi = max(a, span.start), min(b, span.start + span.length)
            if lo < hi:
                runs.append((lo - a, embeds[lo - span.start : hi - span.start]))
        feats = image_features([runs], b - a, width)
        logits = model(
            mx.array([prompt.ids[a:b]]), cache, mx.array(pos[:, None, a:b]), images=feats
        )
    out = [int(mx.argmax(logits[0, -1]))]
    deltas = mx.array([delta])
    while len(out) < max_tokens:
        logits = model(mx.array([[out[-1]]]), cache, rope_deltas=deltas)
        out.append(int(mx.argmax(logits[0, -1])))
    return out


@pytest.fixture(scope="module")
def vlm(tiny_vlm):
    model, processor = load_vlm(tiny_vlm)
    return VisionLanguageModel(model, model.config.model_type), processor


def test_positions_equal_mlx_vlm_get_rope_index(vlm):
    model, processor = vlm
    images = [random_image(0), random_image(1, 60, 150)]
    p = Prompt(model, processor, _chat(IMAGE, _text("and"), IMAGE, _text("compare")), images)
    grids = mx.array([s.grid for s in p.spans])
    want, want_delta = model.vlm.language_model.get_rope_index(mx.array([p.real_ids]), grids)
    got, delta = mrope.positions(len(p.ids), p.spans)
    assert np.array_equal(np.array(want)[:, 0], got) and int(want_delta.item()) == delta
    assert delta < 0 and all(
        t >= model.vocab_size for s in p.spans for t in p.ids[s.start : s.start + s.length]
    )


@pytest.mark.parametrize("where", ["whole", "after the image", "inside the image"])
def test_greedy_parity_with_mlx_vlm(tiny_vlm, vlm, where):
    model, processor = vlm
    messages = _chat(_text("Look:"), IMAGE, _text("What is in the picture?"))
    images = [random_image(3)]
    p = Prompt(model, processor, messages, images)
    span = p.spans[0]
    cuts = {"whole": [], "after the image": [span.start + span.length + 2]}
    cuts["inside the image"] = [span.start + 5, span.start + span.length - 1]
    want = vlm_greedy(tiny_vlm, messages, images, 10)
    assert _run(model, p, cuts[where], 10) == want


def test_two_images_and_text_only_parity(tiny_vlm, vlm):
    model, processor = vlm
    two = _chat(IMAGE, _text("then"), IMAGE, _text("which is brighter?"))
    images = [random_image(4), random_image(5, 90, 70)]
    p = Prompt(model, processor, two, images)
    assert _run(model, p, [p.spans[1].start + 3], 8) == vlm_greedy(tiny_vlm, two, images, 8)
    text = _chat(_text("No picture this time."))
    q = Prompt(model, processor, text, [])
    assert _run(model, q, [4], 8) == vlm_greedy(tiny_vlm, text, [], 8)


def test_a_vision_tower_not_served_is_refused(vlm):
    model, _ = vlm
    with pytest.raises(UnsupportedModel, match="vision tower \\(gemma3\\) is not served"):
        VisionLanguageModel(model.vlm, "gemma3")


def test_pad_values_are_above_the_vocabulary_and_name_the_image():
    a, b = image_hash(_png(random_image(0))), image_hash(_png(random_image(1)))
    assert pad_value(a, 516) == pad_value(image_hash(_png(random_image(0))), 516)
    assert pad_value(a, 516) != pad_value(b, 516)
    assert all(516 <= pad_value(image_hash(bytes([i])), 516) < 2**31 for i in range(256))
    with pytest.raises(ValueError, match="no room"):
        pad_value(a, 2**31)
