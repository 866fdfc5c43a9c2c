"""Hybrid models served by a real `radix-mlx serve`: exact, batched, and hitting the cache.

Qwen3.5, Qwen3-Next and Nemotron-H tiny models through HTTP: concurrent greedy requests
equal mlx-lm's generation; a repeated 1,000-token prompt reuses all but its last token
(the state snapshot at its last-but-one token); the next turn of a conversation reuses
the first turn's prompt and answer (the snapshot taken when it finished); chunked
prefill and a pool far smaller than the load stay exact, with the scheduler's state-slot
invariants checked on every step (--debug-invariants).
"""

from __future__ import annotations

import concurrent.futures
import random

import pytest

from tests.conftest import mlx_greedy
from tests.server import ServerProcess
from tests.test_families_e2e import _complete, assert_small_pool_evicts_retracts_and_matches

pytestmark = pytest.mark.slow

FAMILIES = ["qwen3_5", "qwen3_next", "nemotron_h", "granite4", "falcon_h1"]


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tiny_arch, tmp_path_factory):
    path = tiny_arch(request.param)
    log = tmp_path_factory.mktemp(request.param) / "server.log"
    extra = ["--max-total-tokens", "8192", "--chunked-prefill-size", "256", "--debug-invariants"]
    server = ServerProcess(path, log, extra=extra)
    server.start()
    yield path, server
    assert server.stop() == 0
    assert "Traceback" not in server.log()


def test_concurrent_mixed_lengths_match_mlx_lm(served):
    path, server = served
    rng = random.Random(51)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (70, 3, 100, 18, 64, 41, 9, 80)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: _complete(server, p, 20), prompts))
    for prompt, res in zip(prompts, results):
        assert res["choices"][0]["token_ids"] == mlx_greedy(path, prompt, 20)


def test_repeated_long_prompt_and_next_turn_hit_the_cache(served):
    """1,000 tokens in chunks of 256: the repeat computes one token; the next turn reuses
    the first turn up to its answer's last token."""
    path, server = served
    rng = random.Random(52)
    prompt = [rng.randrange(3, 400) for _ in range(1000)]
    want = mlx_greedy(path, prompt, 16)
    first = _complete(server, prompt, 16)
    again = _complete(server, prompt, 16)
    assert first["choices"][0]["token_ids"] == again["choices"][0]["token_ids"] == want
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
    turn = prompt + want + [rng.randrange(3, 400) for _ in range(20)]
    second = _complete(server, turn, 16)
    assert second["choices"][0]["token_ids"] == mlx_greedy(path, turn, 16)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) + 15


def test_shared_prefix_falls_back_to_the_deepest_snapshot(served):
    """Two prompts sharing 300 tokens: the second reuses at most up to a snapshot inside
    the shared part (a chunk boundary at 256), never past it, and stays exact."""
    path, server = served
    rng = random.Random(53)
    shared = [rng.randrange(3, 400) for _ in range(300)]
    a = shared + [rng.randrange(3, 400) for _ in range(30)]
    b = shared + [rng.randrange(3, 400) for _ in range(40)]
    assert _complete(server, a, 12)["choices"][0]["token_ids"] == mlx_greedy(path, a, 12)
    res = _complete(server, b, 12)
    assert res["choices"][0]["token_ids"] == mlx_greedy(path, b, 12)
    assert res["usage"]["prompt_tokens_details"]["cached_tokens"] == 256


@pytest.mark.parametrize("arch", ["qwen3_5", "nemotron_h", "granite4", "falcon_h1"])
def test_small_pool_evicts_retracts_and_matches_mlx_lm(arch, tiny_arch, tmp_path):
    """Evicted trie nodes free their snapshots too (--debug-invariants counts them)."""
    assert_small_pool_evicts_retracts_and_matches(tiny_arch(arch), tmp_path / "log")
