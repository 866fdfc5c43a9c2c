"""The worker on every standard architecture we claim, including quantized weights."""

from __future__ import annotations

import pytest

from common.messages import DecodeBatch, ExtendBatch, ExtendReq, SamplingParams
from tests.conftest import load_model, mlx_greedy
from worker_mlx.kv_pool import MlxKVPool
from worker_mlx.model_probe import probe_kv_layout
from worker_mlx.model_runner import ModelRunner
from worker_mlx.self_check import batched_path_works

PROMPTS = [[5, 17, 99, 230, 41, 8], [300, 12], list(range(60, 95))]


@pytest.fixture(scope="module")
def quantized_qwen3(tiny_model, tmp_path_factory) -> str:
    from mlx_lm import convert

    out = tmp_path_factory.mktemp("q") / "tiny-q4"
    convert(tiny_model, mlx_path=str(out), quantize=True, q_group_size=32, q_bits=4)
    return str(out)


@pytest.fixture(scope="module", params=["qwen2", "mistral"])
def other_arch(request, model_cache) -> str:
    from common.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model(model_cache, preset="tiny", arch=request.param))


def _check_parity(path: str, n: int = 8, compile_decode: bool = True) -> None:
    model, _ = load_model(path)
    layout = probe_kv_layout(model)
    assert batched_path_works(model, layout, 512, compile_decode)
    runner = ModelRunner(model, MlxKVPool(layout, 256), 512, compile_decode=compile_decode)
    slots = iter(range(1, 257))
    greedy = SamplingParams(temperature=0)
    reqs = [
        ExtendReq(f"r{i}", p, [], [next(slots) for _ in p], greedy) for i, p in enumerate(PROMPTS)
    ]
    outs = [runner.extend(ExtendBatch(0, reqs))]
    for step in range(1, n):
        locs = [next(slots) for _ in PROMPTS]
        outs.append(runner.decode(DecodeBatch(step, ["r0", "r1", "r2"], locs)))
    for row, prompt in enumerate(PROMPTS):
        assert [o.next_token_ids[row] for o in outs] == mlx_greedy(path, prompt, n)


@pytest.mark.parametrize("compile_decode", [True, False])
def test_other_architectures_match_mlx_lm(other_arch, compile_decode):
    _check_parity(other_arch, compile_decode=compile_decode)


def test_quantized_model_matches_mlx_lm(quantized_qwen3):
    model, _ = load_model(quantized_qwen3)
    assert "scales" in str(model.parameters()["model"]["layers"][0]["self_attn"]["q_proj"].keys())
    _check_parity(quantized_qwen3)
