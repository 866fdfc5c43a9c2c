"""The disk tier with LoRA adapters loaded at run time (/admin/loras/load): their blocks
are keyed by a digest of the adapter's files, so a restarted server that loads the same
files again (under any id) serves their prefixes from disk, exactly, while other weights
loaded under the same name never meet them."""

from __future__ import annotations

import time

import httpx
import pytest

from common.cache_salt import stored_namespace
from common.kv_store.block_keys import block_keys
from common.kv_store.fingerprint import adapter_identity
from tests.test_kv_disk_e2e import BLOCK, NEW, _block_files, _metrics, _prompt, _serve
from tests.test_kv_disk_models import _complete_as
from tests.test_lora import adapter_greedy

pytestmark = pytest.mark.slow


def _admin(server, action: str, **body) -> None:
    r = httpx.post(f"{server.url}/admin/loras/{action}", json=body, timeout=60)
    assert r.status_code == 200, r.text


def _wait_adapter_blocks(kv_dir, adapter: str, tokens: list[int], timeout: float = 60) -> None:
    keys = block_keys(tokens, stored_namespace(None, adapter_identity(adapter)), BLOCK)
    deadline = time.monotonic() + timeout
    while not set(keys) <= set(_block_files(kv_dir)):
        assert time.monotonic() < deadline, "the adapter's blocks were not written"
        time.sleep(0.1)


def test_run_time_adapter_blocks_come_back_after_a_restart(tiny_model, tiny_adapters, tmp_path):
    a1, a2 = tiny_adapters
    kv_dir = tmp_path / "kv"
    p = _prompt(95)
    server = _serve(tiny_model, tmp_path / "a.log", kv_dir)
    try:
        _admin(server, "load", lora_name="x", lora_path=a1)
        out, cached = _complete_as(server, "x", p)
        assert cached == 0 and out == adapter_greedy(tiny_model, a1, p, NEW)
        _wait_adapter_blocks(kv_dir, a1, p + out[:-1])
    finally:
        assert server.stop() == 0
    server = _serve(tiny_model, tmp_path / "b.log", kv_dir)
    try:
        # the name with other weights (and a new id): nothing of a1's blocks
        _admin(server, "load", lora_name="x", lora_path=a2)
        got, cached = _complete_as(server, "x", p)
        assert cached == 0 and got == adapter_greedy(tiny_model, a2, p, NEW)
        _admin(server, "unload", lora_name="x")
        # a1's files again, under a third id: its prefix from disk
        _admin(server, "load", lora_name="x", lora_path=a1)
        turn = p + out + _prompt(96, 12)
        got, cached = _complete_as(server, "x", turn)
        assert got == adapter_greedy(tiny_model, a1, turn, NEW)
        assert cached == 5 * BLOCK
        assert _metrics(server)['radix_mlx_cache_hit_tokens_total{tier="disk"}'] == 5 * BLOCK
        assert "Traceback" not in server.log()
    finally:
        assert server.stop() == 0
