"""The persistent KV tier end to end (--kv-disk-dir): a prefix evicted from a small pool
comes back from disk, a restarted server serves an old conversation's next turn from
disk, a damaged block is recomputed and counted; every output token-exact with mlx-lm's
greedy generation."""

from __future__ import annotations

import random
import time
from pathlib import Path

import httpx
import pytest

from common.kv_store.block_keys import block_keys
from tests.conftest import mlx_greedy
from tests.server import ServerProcess
from tests.test_metrics import parse

pytestmark = pytest.mark.slow

BLOCK = 64
POOL = 512
PROMPT = BLOCK * 5 + 4  # five whole blocks and a tail
NEW = 16


def _serve(model: str, log: Path, kv_dir: Path, *extra: str) -> ServerProcess:
    args = ["--kv-disk-dir", str(kv_dir), "--kv-disk-block-tokens", str(BLOCK)]
    args += ["--max-total-tokens", str(POOL), "--debug-invariants", *extra]
    server = ServerProcess(model, log, extra=args)
    server.start()
    return server


def _complete(server: ServerProcess, prompt: list[int], n: int = NEW) -> tuple[list[int], int]:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    res = httpx.post(server.url + "/v1/completions", json=body, timeout=300).json()
    assert "choices" in res, res
    return res["choices"][0]["token_ids"], res["usage"]["prompt_tokens_details"]["cached_tokens"]


def _prompt(seed: int, n: int = PROMPT) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def _block_files(kv_dir: Path) -> dict[str, Path]:
    return {p.name.split(".")[0]: p for p in kv_dir.glob("*/blocks/*/*.safetensors")}


def _wait_saved(kv_dir: Path, tokens: list[int], timeout: float = 60) -> None:
    """The writer thread wrote every whole block of `tokens`."""
    keys = block_keys(tokens, 0, BLOCK)
    deadline = time.monotonic() + timeout
    while not set(keys) <= set(_block_files(kv_dir)):
        assert time.monotonic() < deadline, "blocks were not written"
        time.sleep(0.1)


def _metrics(server: ServerProcess) -> dict[str, float]:
    return parse(httpx.get(server.url + "/metrics", timeout=10).text)


@pytest.fixture(scope="module")
def turns(tiny_model, tmp_path_factory):
    """Server A: two conversations' first turns, a pool-filling load that evicts them,
    and one of them again (from disk). Returns what server B needs."""
    tmp = tmp_path_factory.mktemp("kv_disk")
    kv_dir = tmp / "kv"
    server = _serve(tiny_model, tmp / "a.log", kv_dir)
    try:
        p, q = _prompt(1), _prompt(2)
        out_p, cached = _complete(server, p)
        assert cached == 0 and out_p == mlx_greedy(tiny_model, p, NEW)
        out_q, _ = _complete(server, q)
        for seed in range(10, 13):  # each fills most of the pool: p and q are evicted
            _complete(server, _prompt(seed, POOL - 40), 8)
        _wait_saved(kv_dir, p + out_p[:-1])
        again, cached = _complete(server, p)
        assert again == out_p
        assert cached == 5 * BLOCK  # all five blocks from disk (the tail recomputed)
        metrics = _metrics(server)
        assert metrics['radix_mlx_cache_hit_tokens_total{tier="disk"}'] >= 5 * BLOCK
        assert metrics["radix_mlx_evicted_tokens_total"] > 0
        log = server.log()
        assert f"#disk-cached-token: {5 * BLOCK}" in log
        assert "Traceback" not in log and "slots lost" not in log
        # the next turn, evicted again: p's blocks and then its tail (its last 4 tokens
        # and the answer, a short block) come from disk, all but the answer's last token
        for seed in range(20, 23):
            _complete(server, _prompt(seed, POOL - 40), 8)
        next_turn = p + out_p + _prompt(5, 8)
        out, cached = _complete(server, next_turn)
        assert out == mlx_greedy(tiny_model, next_turn, NEW)
        assert cached == len(p) + NEW - 1
        _wait_saved(kv_dir, q + out_q[:-1])
    finally:
        assert server.stop() == 0
    return kv_dir, tmp, (p, out_p), (q, out_q)


def test_evicted_prefix_comes_back_from_disk_exactly(turns):
    kv_dir, *_ = turns
    assert len(_block_files(kv_dir)) >= 10


def test_restart_serves_next_turn_from_disk_and_recomputes_a_damaged_block(tiny_model, turns):
    kv_dir, tmp, (p, out_p), (q, out_q) = turns
    damaged = _block_files(kv_dir)[block_keys(q, 0, BLOCK)[2]]
    data = bytearray(damaged.read_bytes())
    data[-7] ^= 0x10  # one bit of the KV data
    damaged.write_bytes(bytes(data))
    server = _serve(tiny_model, tmp / "b.log", kv_dir)
    try:
        next_turn = p + out_p + _prompt(3, 12)
        out, cached = _complete(server, next_turn)
        assert out == mlx_greedy(tiny_model, next_turn, NEW)
        assert cached >= 0.95 * len(p)  # the previous turn's prompt came back from disk
        out, cached = _complete(server, q)
        assert out == out_q  # the damaged block and those after it were recomputed
        assert cached == 2 * BLOCK
        metrics = _metrics(server)
        assert metrics['radix_mlx_kv_disk_errors_total{reason="checksum"}'] == 1
        assert metrics['radix_mlx_cache_hit_tokens_total{tier="disk"}'] >= 7 * BLOCK
        assert metrics["radix_mlx_kv_disk_blocks"] > 0
        assert "checksum mismatch" in server.log()
    finally:
        assert server.stop() == 0


def test_unwritable_directory_warns_and_serves(tiny_model, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the directory would go")
    server = _serve(tiny_model, tmp_path / "c.log", blocker / "kv")
    try:
        p = _prompt(4)
        out, _ = _complete(server, p)
        assert out == mlx_greedy(tiny_model, p, NEW)
        assert _complete(server, p)[0] == out
        assert "the tier stops writing" in server.log()
        metrics = _metrics(server)  # nothing was promised to the scheduler, so none is
        assert metrics['radix_mlx_kv_disk_errors_total{reason="missing"}'] == 0  # missed
    finally:
        assert server.stop() == 0
