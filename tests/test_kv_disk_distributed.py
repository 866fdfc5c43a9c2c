"""The disk tier on a distributed worker (--tp-size 2, --pp-size 2 on the tiny Qwen3):
every rank saves and loads its own part of each block, the group lists only blocks every
rank holds and installs a load only where every rank read it. An evicted prefix and a
restarted server's next turn come back from disk token-exact with mlx-lm's greedy
generation; a part missing on one rank (before the start or while it serves) is
recomputed, never served from a partial block."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from common.kv_store.block_keys import block_keys, root_key
from common.kv_store.file_store import FileBlockStore
from tests.conftest import mlx_greedy
from tests.test_kv_disk_e2e import BLOCK, NEW, POOL, _complete, _metrics, _prompt, _serve
from worker_mlx.kv_disk_group import PART_GRACE_SECONDS, partial_blocks

RANKS = 2
MISSING_WARNING = "is missing or damaged on another rank"


def test_parts_of_one_directory_never_meet(tmp_path):
    """Two ranks' stores in one group directory: each lists, reads and evicts only its
    own part files, and a part file renamed to another rank's is refused."""
    arrays = {"p0": np.arange(8, dtype=np.uint8)}
    key, parent = block_keys(list(range(4)), 0, 4)[0], root_key(0)
    r0 = FileBlockStore(tmp_path, "group", 1 << 20, "r0of2")
    r1 = FileBlockStore(tmp_path, "group", 1 << 20, "r1of2")
    assert r0.put(key, parent, list(range(4)), arrays)
    assert r0.keys() == [key] and r1.keys() == [] and r1.rescan() == []
    files = sorted(p.name for p in (tmp_path / "group" / "blocks").glob("*/*"))
    assert files == [f"{key}.r0of2.safetensors"]
    mine = r0._path(key)
    mine.rename(r1._path(key))  # another rank's name: its fingerprint says otherwise
    assert r1.rescan() == [key]
    with pytest.raises(Exception, match="another model"):
        r1.get(key)
    assert FileBlockStore(tmp_path, "group", 1 << 20).keys() == []  # a single process's


def test_rank_0_finds_blocks_another_rank_lost(tmp_path):
    """On the ranks' shared directory: a block whose other part is gone is reported once
    its own part is past the grace (the other rank may still be writing a fresh one)."""
    arrays = {"p0": np.arange(8, dtype=np.uint8)}
    r0 = FileBlockStore(tmp_path, "group", 1 << 20, "r0of2")
    r1 = FileBlockStore(tmp_path, "group", 1 << 20, "r1of2")
    both, alone = block_keys(list(range(8)), 0, 4)
    r0.put(both, root_key(0), list(range(4)), arrays)
    r0.put(alone, both, list(range(4, 8)), arrays)
    r1.put(both, root_key(0), list(range(4)), arrays)
    now = time.time()
    assert partial_blocks(r0, ["r1of2"], now) == []  # fresh: rank 1 may be writing it
    later = now + PART_GRACE_SECONDS + 1
    assert partial_blocks(r0, ["r1of2"], later) == [alone]
    r1.forget(both)
    assert sorted(partial_blocks(r0, ["r1of2"], later)) == sorted([both, alone])


def _parts(kv_dir: Path) -> dict[tuple[str, str], Path]:
    """(key, part) -> file of every rank's block parts."""
    out = {}
    for path in kv_dir.glob("*/blocks/*/*.safetensors"):
        key, part, _ = path.name.split(".")
        out[key, part] = path
    return out


def _wait_parts(kv_dir: Path, tokens: list[int], timeout: float = 60) -> list[str]:
    """Every rank wrote its part of every whole block of `tokens`; their keys."""
    keys = block_keys(tokens, 0, BLOCK)
    want = {(k, f"r{r}of{RANKS}") for k in keys for r in range(RANKS)}
    deadline = time.monotonic() + timeout
    while not want <= set(_parts(kv_dir)):
        assert time.monotonic() < deadline, "block parts were not written"
        time.sleep(0.1)
    return keys


def _evict(server) -> None:
    for seed in range(10, 13):  # each fills most of the pool
        _complete(server, _prompt(seed, POOL - 40), 2)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tp", "pp"])
def test_group_serves_evicted_and_restarted_prefixes_from_disk(tiny_model, tmp_path, mode):
    kv = tmp_path / "kv"
    flags = [f"--{mode}-size", str(RANKS), "--watchdog-timeout", "60"]
    server = _serve(tiny_model, tmp_path / "a.log", kv, *flags)
    try:
        p, q, r = _prompt(41), _prompt(42), _prompt(43)
        out_p, cached = _complete(server, p)
        assert cached == 0 and out_p == mlx_greedy(tiny_model, p, NEW)
        out_q, out_r = _complete(server, q)[0], _complete(server, r)[0]
        for tokens in (p + out_p, q + out_q, r + out_r):
            _wait_parts(kv, tokens[:-1])
        _evict(server)
        again, cached = _complete(server, p)
        assert again == out_p and cached == 5 * BLOCK  # every rank's part from disk
        assert "Traceback" not in server.log()
    finally:
        assert server.stop() == 0
    assert {p.parent.parent.parent.name for p in _parts(kv).values()} == {_group_dir(kv)}
    r_keys, q_keys = block_keys(r, 0, BLOCK), block_keys(q, 0, BLOCK)
    _parts(kv)[r_keys[3], f"r1of{RANKS}"].unlink()  # before the start: not listed
    server = _serve(tiny_model, tmp_path / "b.log", kv, *flags)
    try:
        turn = p + out_p + _prompt(44, 12)
        out, cached = _complete(server, turn)
        assert out == mlx_greedy(tiny_model, turn, NEW)
        assert cached >= 0.95 * len(p)
        out, cached = _complete(server, r)
        assert out == out_r and cached == 3 * BLOCK
        assert MISSING_WARNING not in server.log()  # never asked for: the group lacked it
        _parts(kv)[q_keys[2], f"r1of{RANKS}"].unlink()  # while serving: found at the load
        out, cached = _complete(server, q)
        assert out == out_q and cached == 2 * BLOCK
        log = server.log()  # found by the load, or (rarely, a rescan came first) by rank 0
        assert MISSING_WARNING in log or "lost another rank's part" in log
        if MISSING_WARNING in log:
            assert _metrics(server)['radix_mlx_kv_disk_errors_total{reason="missing"}'] >= 1
        assert "Traceback" not in server.log()
    finally:
        assert server.stop() == 0


def _group_dir(kv: Path) -> str:
    (only,) = [d.name for d in kv.iterdir() if d.is_dir()]
    return only
