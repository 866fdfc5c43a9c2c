"""The worker's view of a vision-language model: pad values in the token sequence, the
vision tower's embeddings merged at their positions, Qwen-VL's M-RoPE positions computed
from the image spans alone, prefill cut anywhere (inside an image too) and decode with the
row's RoPE delta, token for token as mlx-vlm's own greedy generation."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from common.image_keys import image_hash, pad_value
from common.tiny_vlm import VLM_FAMILIES, ensure_tiny_vlm
from tests.conftest import load_vlm, random_image, vlm_greedy
from tests.vision_prompts import IMAGE, Prompt, chat, png, text
from worker_mlx import mrope
from worker_mlx.model_probe import UnsupportedModel
from worker_mlx.vision_model import VisionLanguageModel, image_features


def _run(model: VisionLanguageModel, prompt: Prompt, cuts: list[int], max_tokens: int):
    """Prefill in pieces ending at `cuts`, then greedy decode: the tokens."""
    cache = model.make_cache()
    pos, delta = mrope.positions(len(prompt.ids), prompt.spans)
    bounds = [0, *cuts, len(prompt.ids)]
    for a, b in zip(bounds, bounds[1:]):
        runs = []
        for span, embeds in zip(prompt.spans, prompt.embeds):
            lo, hi = max(a, span.start), min(b, span.start + span.length)
            if lo < hi:
                runs.append((lo - a, embeds[lo - span.start : hi - span.start]))
        feats = image_features([runs], b - a)
        positions = mx.array(pos[:, None, a:b]) if model.mrope else None
        logits = model(mx.array([prompt.ids[a:b]]), cache, positions, images=feats)
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


@pytest.fixture(scope="module", params=VLM_FAMILIES)
def family(request, model_cache):
    """(path, model, processor) of each served family's tiny VLM."""
    path = str(ensure_tiny_vlm(model_cache, arch=request.param))
    vlm, processor = load_vlm(path)
    return path, VisionLanguageModel(vlm, vlm.config.model_type), processor


def test_positions_equal_mlx_vlm_get_rope_index(family):
    _, model, processor = family
    if not model.mrope:
        pytest.skip("Gemma 3's positions are the cache offsets, no M-RoPE")
    images = [random_image(0), random_image(1, 60, 150)]
    p = Prompt(model, processor, chat(IMAGE, text("and"), IMAGE, text("compare")), images)
    grids = mx.array([s.grid for s in p.spans])
    want, want_delta = model.vlm.language_model.get_rope_index(mx.array([p.real_ids]), grids)
    got, delta = mrope.positions(len(p.ids), p.spans)
    assert np.array_equal(np.array(want)[:, 0], got) and int(want_delta.item()) == delta
    assert delta < 0 and all(
        t >= model.vocab_size for s in p.spans for t in p.ids[s.start : s.start + s.length]
    )


@pytest.mark.parametrize("where", ["whole", "after the image", "inside the image"])
def test_greedy_parity_with_mlx_vlm(family, where):
    """Every family, its prefill cut anywhere: mlx-vlm's own greedy tokens."""
    tiny_vlm, model, processor = family
    messages = chat(text("Look:"), IMAGE, text("What is in the picture?"))
    images = [random_image(3)]
    p = Prompt(model, processor, messages, images)
    span = p.spans[0]
    cuts = {"whole": [], "after the image": [span.start + span.length + 2]}
    cuts["inside the image"] = [span.start + 1, span.start + span.length - 1]
    want = vlm_greedy(tiny_vlm, messages, images, 10)
    assert _run(model, p, cuts[where], 10) == want


def test_two_images_and_text_only_parity(family):
    tiny_vlm, model, processor = family
    two = chat(IMAGE, text("then"), IMAGE, text("which is brighter?"))
    images = [random_image(4), random_image(5, 90, 70)]
    p = Prompt(model, processor, two, images)
    assert _run(model, p, [p.spans[1].start + 3], 8) == vlm_greedy(tiny_vlm, two, images, 8)
    plain = chat(text("No picture this time."))
    q = Prompt(model, processor, plain, [])
    assert _run(model, q, [4], 8) == vlm_greedy(tiny_vlm, plain, [], 8)


def test_a_vision_tower_not_served_is_refused(vlm):
    model, _ = vlm
    with pytest.raises(UnsupportedModel, match="vision tower \\(llava\\) is not served"):
        VisionLanguageModel(model.vlm, "llava")


def test_pad_values_are_above_the_vocabulary_and_name_the_image():
    a, b = image_hash(png(random_image(0))), image_hash(png(random_image(1)))
    assert pad_value(a, 516) == pad_value(image_hash(png(random_image(0))), 516)
    assert pad_value(a, 516) != pad_value(b, 516)
    assert all(516 <= pad_value(image_hash(bytes([i])), 516) < 2**31 for i in range(256))
    with pytest.raises(ValueError, match="no room"):
        pad_value(a, 2**31)
