"""The disk tier across model kinds and limits: a sliding-window model, n-gram and
draft-model speculation, an int8 pool and hybrid (recurrent: gated-delta, Mamba-2) models serve an
evicted prefix from disk with the same tokens, the hybrids also after a restart; a budget
of a few blocks holds, also across a worker killed while it writes."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from common.kv_store.block_keys import block_keys, state_key
from common.tiny_model import build_draft_model
from tests.conftest import mlx_greedy
from tests.test_kv_disk_e2e import (
    BLOCK,
    NEW,
    POOL,
    _block_files,
    _complete,
    _metrics,
    _prompt,
    _serve,
    _wait_saved,
)
from tests.test_lora import adapter_greedy
from worker_mlx.kv_disk_writer import RESCAN_SECONDS

pytestmark = pytest.mark.slow


def _evict(server) -> None:
    for seed in range(10, 13):  # each fills most of the pool
        _complete(server, _prompt(seed, POOL - 40), 4)


def _wait_state_saved(kv_dir, tokens: list[int], timeout: float = 60) -> None:
    """The state after the last whole block of `tokens` is on disk too (recurrent)."""
    key = state_key(block_keys(tokens, 0, BLOCK)[-1])
    deadline = time.monotonic() + timeout
    while key not in _block_files(kv_dir):
        assert time.monotonic() < deadline, "the state was not written"
        time.sleep(0.1)


@pytest.mark.parametrize(
    "arch, preset, flags",
    [
        ("mistral_swa", "tiny", []),
        ("qwen3", "tiny", ["--speculative-algorithm", "ngram"]),
        ("qwen3", "tiny", ["--speculative-algorithm", "draft"]),  # its KV in the blocks too
        ("qwen3", "small", ["--kv-cache-dtype", "int8"]),  # head dim 64: one group
        ("qwen3_next", "tiny", []),  # gated-delta layers: their states come back too
        ("granite4", "tiny", []),  # Mamba-2 layers
    ],
    ids=["sliding-window", "ngram", "draft", "int8", "hybrid-gated-delta", "hybrid-mamba2"],
)
def test_evicted_prefix_from_disk_is_exact(tiny_arch, tmp_path, arch, preset, flags):
    """Cold, then evicted and served from disk; a recurrent model's state at the last
    block end comes back with the blocks, also in a restarted server's next turn."""
    model = tiny_arch(arch, preset)
    hybrid = arch in ("qwen3_next", "granite4")
    if "draft" in flags:
        draft = build_draft_model(model, tmp_path / "draft", layers=1)
        flags = [*flags, "--speculative-draft-model-path", str(draft)]
    server = _serve(model, tmp_path / "log", tmp_path / "kv", *flags)
    try:
        p = _prompt(21)
        cold, cached = _complete(server, p)
        assert cached == 0
        if "int8" not in flags:  # an int8 pool is compared with its own cold tokens
            assert cold == mlx_greedy(model, p, NEW)
        _wait_saved(tmp_path / "kv", p + cold[:-1])
        if hybrid:
            _wait_state_saved(tmp_path / "kv", p[:-1])
        _evict(server)
        again, cached = _complete(server, p)
        assert again == cold and cached == 5 * BLOCK
        assert "Traceback" not in server.log()
    finally:
        assert server.stop() == 0
    if hybrid:
        _restarted_next_turn(model, tmp_path, p + cold + _prompt(23, 12))


def _restarted_next_turn(model: str, tmp_path, turn: list[int]) -> None:
    server = _serve(model, tmp_path / "log2", tmp_path / "kv")
    try:
        out, cached = _complete(server, turn)
        assert out == mlx_greedy(model, turn, NEW)
        assert cached == 5 * BLOCK  # to the last block end with a stored state
        assert _metrics(server)['radix_mlx_cache_hit_tokens_total{tier="disk"}'] == 5 * BLOCK
        assert "Traceback" not in server.log()
    finally:
        assert server.stop() == 0


def _held(kv_dir) -> int:
    return sum(f.stat().st_size for f in kv_dir.glob("*/blocks/*/*") if f.is_file())


def test_small_budget_holds_and_a_killed_writer_serves_no_wrong_token(tiny_model, tmp_path):
    kv_dir = tmp_path / "kv"
    budget = 150 << 10  # about four blocks of the tiny model
    server = _serve(tiny_model, tmp_path / "log", kv_dir, "--kv-disk-budget", str(budget))
    try:
        block = 0
        for seed in range(30, 34):
            p = _prompt(seed)
            assert _complete(server, p)[0] == mlx_greedy(tiny_model, p, NEW)
            files = _block_files(kv_dir)
            if files:
                block = max(block, max(f.stat().st_size for f in files.values()))
            assert _held(kv_dir) <= budget + block  # a temporary file at most
        time.sleep(1)
        assert 0 < _held(kv_dir) <= budget
        assert 0 < _metrics(server)["radix_mlx_kv_disk_bytes"] <= budget
        p = _prompt(35)
        out, _ = _complete(server, p)
        os.kill(server.child("worker"), signal.SIGKILL)  # while its blocks are written
        _wait_healthy(server)
        again, _ = _complete(server, p)
        assert again == out == mlx_greedy(tiny_model, p, NEW)
    finally:
        assert server.stop() == 0


def _wait_healthy(server, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    time.sleep(0.5)
    while time.monotonic() < deadline:
        try:
            if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not come back")


def test_replicas_share_the_directory(tiny_model, tmp_path):
    """--dp-size 2, round robin: a prompt one replica computed is served from disk by the
    other, which learnt of its blocks by rescanning the directory."""
    kv_dir = tmp_path / "kv"
    flags = ("--dp-size", "2", "--routing-policy", "round_robin")
    server = _serve(tiny_model, tmp_path / "log", kv_dir, *flags)
    try:
        _wait_replicas(server, 2)
        p = _prompt(40)
        out, _ = _complete(server, p)  # r0
        _wait_saved(kv_dir, p + out[:-1])
        time.sleep(RESCAN_SECONDS + 1.5)
        _complete(server, _prompt(41, 20))  # r1: its reply brings the rescan's news
        _complete(server, _prompt(42, 20))  # r0
        again, cached = _complete(server, p)  # r1, whose pool never held p
        assert again == out == mlx_greedy(tiny_model, p, NEW)
        assert cached == 5 * BLOCK
        metrics = _metrics(server)
        assert metrics['radix_mlx_cache_hit_tokens_total{replica="r1",tier="disk"}'] == 5 * BLOCK
    finally:
        assert server.stop() == 0


def _wait_replicas(server, n: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = [r["state"] for r in httpx.get(server.url + "/health").json()["replicas"]]
        if states.count("ready") == n:
            return
        time.sleep(0.3)
    raise AssertionError("the replicas did not all start")


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"], ids=["attention", "hybrid"])
def test_concurrent_sessions_on_a_small_pool_stay_exact(tiny_arch, tmp_path, arch):
    """Concurrent sessions on a pool that must evict and retract: loads run while other
    requests decode, and every output is mlx-lm's (--debug-invariants checks the slot
    accounting, state slots too, after every step and load)."""
    import concurrent.futures

    tiny_model = tiny_arch(arch)

    # room for about three requests at once: loads overlap other requests' decode steps
    server = _serve(tiny_model, tmp_path / "log", tmp_path / "kv", "--max-total-tokens", "1200")
    try:
        bases = [_prompt(50 + i, 200 + 40 * i) for i in range(4)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            firsts = list(pool.map(lambda p: _complete(server, p, 24)[0], bases))
            for base, out in zip(bases, firsts):
                _wait_saved(tmp_path / "kv", base + out[:-1])
            for seed in (80, 81):  # the pool forgets the first turns
                _complete(server, _prompt(seed, 1100), 4)
            turns = [b + o + _prompt(60 + i, 16) for i, (b, o) in enumerate(zip(bases, firsts))]
            load = turns + [_prompt(70 + i, 300) for i in range(4)]
            seconds = list(pool.map(lambda p: _complete(server, p, 48)[0], load))
        for prompt, out in zip(bases, firsts):
            assert out == mlx_greedy(tiny_model, prompt, 24)
        for prompt, out in zip(load, seconds):
            assert out == mlx_greedy(tiny_model, prompt, 48)
        assert _metrics(server)['radix_mlx_cache_hit_tokens_total{tier="disk"}'] > 0
        log = server.log()
        assert "Traceback" not in log and "slots lost" not in log and "two owners" not in log
    finally:
        assert server.stop() == 0


def _complete_as(server, model: str, prompt: list[int]) -> tuple[list[int], int]:
    body = {"model": model, "prompt": prompt, "max_tokens": NEW, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    res = httpx.post(server.url + "/v1/completions", json=body, timeout=300).json()
    assert "choices" in res, res
    return res["choices"][0]["token_ids"], res["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_adapter_blocks_follow_the_adapter_across_reordered_lora_flags(
    tiny_model, tiny_adapters, tmp_path
):
    """Blocks an adapter wrote are keyed by the adapter's files, not its --lora position:
    after a restart that swaps the flags, that adapter's next turn comes from disk
    exactly, while the adapter now at its old position and the base recompute."""
    a1, a2 = tiny_adapters
    base = os.path.basename(tiny_model)
    p = _prompt(90)
    server = _serve(tiny_model, tmp_path / "a.log", tmp_path / "kv", "--lora", f"a1={a1}",
                    "--lora", f"a2={a2}")  # fmt: skip
    try:
        out, _ = _complete_as(server, "a1", p)
        assert out == adapter_greedy(tiny_model, a1, p, NEW)
        deadline = time.monotonic() + 60
        while len(_block_files(tmp_path / "kv")) < 5:  # its five whole blocks, nothing else
            assert time.monotonic() < deadline, "the adapter's blocks were not written"
            time.sleep(0.1)
    finally:
        assert server.stop() == 0
    server = _serve(tiny_model, tmp_path / "b.log", tmp_path / "kv", "--lora", f"a2={a2}",
                    "--lora", f"a1={a1}")  # fmt: skip
    try:
        for model, adapter in ((base, None), ("a2", a2)):  # a2 has a1's old position
            got, cached = _complete_as(server, model, p)
            assert cached == 0 and got == adapter_greedy(tiny_model, adapter, p, NEW)
        turn = p + out + _prompt(91, 12)
        got, cached = _complete_as(server, "a1", turn)
        assert got == adapter_greedy(tiny_model, a1, turn, NEW)
        assert cached == 5 * BLOCK
        assert "Traceback" not in server.log()
    finally:
        assert server.stop() == 0
