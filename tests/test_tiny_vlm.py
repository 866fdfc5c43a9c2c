"""The offline tiny vision-language model: mlx-vlm loads it and its image changes the answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import load_vlm, random_image, vlm_greedy

ASK = [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]


def _chat(content) -> list[dict]:
    return [{"role": "user", "content": content}]


def test_processor_expands_the_placeholder_to_the_image_grid(tiny_vlm):
    """One placeholder token per merged 2x2 patch group, as the processor's grid says."""
    model, processor = load_vlm(tiny_vlm)
    config = json.loads((Path(tiny_vlm) / "config.json").read_text())
    prompt = processor.tokenizer.apply_chat_template(
        _chat(ASK), tokenize=False, add_generation_prompt=True
    )
    inputs = processor(images=[random_image(0)], text=[prompt], return_tensors="np")
    ids = inputs["input_ids"].tolist()[0]
    grid = inputs["image_grid_thw"].tolist()
    assert grid == [[1, 6, 8]]  # 80 x 100 pixels resized to 84 x 112, 14-pixel patches
    assert ids.count(config["image_token_id"]) == 6 * 8 // 4
    assert max(ids) < config["vocab_size"]


def test_mlx_vlm_generates_greedily_from_the_image(tiny_vlm):
    """mlx-vlm's own generation runs on the tiny model, and the picture matters."""
    first = vlm_greedy(tiny_vlm, _chat(ASK), [random_image(0)], 12)
    assert len(first) == 12 and len(set(first)) > 3
    assert vlm_greedy(tiny_vlm, _chat(ASK), [random_image(0)], 12) == first
    assert vlm_greedy(tiny_vlm, _chat(ASK), [random_image(1)], 12) != first


def test_unknown_vision_arch_is_refused(tmp_path):
    from common.tiny_vlm import build_tiny_vlm

    with pytest.raises(ValueError, match="unknown vision arch"):
        build_tiny_vlm(tmp_path, arch="nope")
