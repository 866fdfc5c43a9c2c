"""The disk tier on a sliding-window model (the tiny Mistral: two 16-token windowed layers
and one global): a block stores its global layer's KV, and its windowed layers' KV only
where a later prompt's window reaches (before the saved prefix's end), so a saved prefix
takes about a third of the bytes; a prompt that ends its match at a block without that KV
falls back to recomputing, and every output is mlx-lm's, across a restart."""

from __future__ import annotations

import re
import time

import pytest

from common.kv_store.block_keys import block_keys, window_key
from tests.conftest import mlx_greedy
from tests.test_kv_disk_e2e import BLOCK, NEW, _block_files, _complete, _metrics, _prompt, _serve

pytestmark = pytest.mark.slow


def _wait_files(kv_dir, keys: list[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not set(keys) <= set(_block_files(kv_dir)):
        assert time.monotonic() < deadline, "blocks were not written"
        time.sleep(0.1)


def test_sliding_layers_store_only_the_window_and_stay_exact(tiny_arch, tmp_path):
    model = tiny_arch("mistral_swa")
    kv_dir = tmp_path / "kv"
    p = _prompt(27)
    server = _serve(model, tmp_path / "a.log", kv_dir)
    try:
        out, _ = _complete(server, p)
        assert out == mlx_greedy(model, p, NEW)
        keys = block_keys(p + out[:-1], 0, BLOCK)  # five blocks; the 16-token window: one
        _wait_files(kv_dir, [*keys, window_key(keys[-1])])
        token_bytes = int(re.search(r"KV pool: \d+ tokens x (\d+) bytes", server.log())[1])
    finally:
        assert server.stop() == 0
    files = _block_files(kv_dir)
    assert set(files) == {*keys, window_key(keys[-1])}
    held = sum(f.stat().st_size for f in files.values())
    every_layer = len(keys) * BLOCK * token_bytes  # what blocks of all layers' KV hold
    assert held < 0.5 * every_layer, (held, every_layer)

    server = _serve(model, tmp_path / "b.log", kv_dir, "--max-total-tokens", "2048")  # no eviction
    try:
        turn = p + out + _prompt(28, 12)
        got, cached = _complete(server, turn)  # blocks 0-3 load without their window
        assert got == mlx_greedy(model, turn, NEW) and cached == 5 * BLOCK
        # shares three blocks with it, whose windowed layers' KV neither the pool (loaded
        # without it) nor the disk holds: recomputed
        q = p[: 3 * BLOCK] + _prompt(29, 40)
        want_q = mlx_greedy(model, q, NEW)
        got, cached = _complete(server, q)
        assert got == want_q and cached == 0
        got, cached = _complete(server, q)  # its KV took the windowless slots' place
        assert got == want_q and cached == len(q) - 1
        got, cached = _complete(server, turn)  # through both kinds of nodes
        assert got == mlx_greedy(model, turn, NEW) and cached == len(turn) - 1
        assert _metrics(server)['radix_mlx_cache_hit_tokens_total{tier="disk"}'] == 5 * BLOCK
        log = server.log()
        assert "Traceback" not in log and "slots lost" not in log and "two owners" not in log
    finally:
        assert server.stop() == 0
