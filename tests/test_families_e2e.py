"""Each 2026 family served by a real `radix-mlx serve`: exact, batched, cached, evicting.

Sliding-window (Mistral-style, Gemma 3, gpt-oss with sinks), latent-attention
(DeepSeek-V3) and mixture-of-experts (qwen3_moe) tiny models, through HTTP: concurrent
greedy requests equal mlx-lm's generation, a repeated prompt computes one token, the
next turn of a conversation reuses the previous one, and a pool far smaller than the
load evicts and retracts with every output still exact.
"""

from __future__ import annotations

import concurrent.futures
import random

import httpx
import pytest

from tests.conftest import mlx_greedy
from tests.server import ServerProcess
from tests.test_eviction_e2e import _metric, _wait_idle, _workload

pytestmark = pytest.mark.slow

FAMILIES = ["mistral_swa", "local_swa", "gemma3", "gemma4", "gpt_oss", "deepseek_v3", "qwen3_moe"]


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tiny_arch, tmp_path_factory):
    path = tiny_arch(request.param)
    log = tmp_path_factory.mktemp(request.param) / "server.log"
    server = ServerProcess(path, log, extra=["--max-total-tokens", "4096", "--debug-invariants"])
    server.start()
    yield path, server
    assert server.stop() == 0
    assert "Traceback" not in server.log()


def _complete(server: ServerProcess, prompt: list[int], n: int) -> dict:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_concurrent_mixed_lengths_match_mlx_lm(served):
    path, server = served
    rng = random.Random(31)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (70, 3, 100, 18, 64, 41, 9, 80)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: _complete(server, p, 24), prompts))
    for prompt, res in zip(prompts, results):
        assert res["choices"][0]["token_ids"] == mlx_greedy(path, prompt, 24)


def test_repeat_and_next_turn_hit_the_cache(served):
    path, server = served
    rng = random.Random(32)
    prompt = [rng.randrange(3, 400) for _ in range(90)]
    first = _complete(server, prompt, 20)
    again = _complete(server, prompt, 20)
    want = mlx_greedy(path, prompt, 20)
    assert first["choices"][0]["token_ids"] == again["choices"][0]["token_ids"] == want
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
    turn = prompt + want + [rng.randrange(3, 400) for _ in range(12)]
    second = _complete(server, turn, 20)
    assert second["choices"][0]["token_ids"] == mlx_greedy(path, turn, 20)
    # the first turn's prompt and answer, but the answer's last token (it has no KV yet)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) + 19


@pytest.mark.parametrize("arch", ["gemma4", "gpt_oss", "deepseek_v3"])
def test_small_pool_evicts_retracts_and_matches_mlx_lm(arch, tiny_arch, tmp_path):
    assert_small_pool_evicts_retracts_and_matches(tiny_arch(arch), tmp_path / "log")


def assert_small_pool_evicts_retracts_and_matches(path: str, log) -> None:
    """16 concurrent requests on a 256-token pool: every output exact, and eviction and
    retraction both happened, with the slot invariants checked every step."""
    server = ServerProcess(path, log, extra=["--max-total-tokens", "256", "--debug-invariants"])
    server.start()
    try:
        for seed in range(3):  # until both happened: how often depends on timing
            load = _workload(seed)
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                results = list(pool.map(lambda item: _complete(server, *item), load))
            for (prompt, n), res in zip(load, results):
                assert res["choices"][0]["token_ids"] == mlx_greedy(path, prompt, n)
            metrics = _wait_idle(server)
            evicted = _metric(metrics, "radix_mlx_evicted_tokens_total")
            if evicted and _metric(metrics, "radix_mlx_retracted_requests_total"):
                break
        else:
            raise AssertionError(f"no eviction and retraction in 3 loads: {metrics}")
        assert "Traceback" not in server.log()
    finally:
        assert server.stop() == 0


def test_a_model_mlx_lm_cannot_load_is_refused_with_one_line(tiny_model, tmp_path):
    """A model type mlx-lm has no class for (a vision-language wrapper here) ends the
    server at start-up with one line naming it: no traceback, never a healthy server."""
    import json
    import shutil
    import subprocess

    from tests.server import RADIX_MLX

    model = tmp_path / "vlm"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "llava_next"
    (model / "config.json").write_text(json.dumps(config))
    out = subprocess.run(
        [RADIX_MLX, "serve", "--model-path", str(model), "--port", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    refusals = [line for line in out.stderr.splitlines() if f"cannot serve {model}" in line]
    assert len(refusals) == 1 and "llava_next" in refusals[0], out.stderr
