"""The disk tier's file backend: blocks round-trip, and a damaged, foreign or missing
block is refused with its reason, never served; the budget holds; an unwritable
directory stops writing with one warning."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from common.cache_salt import salt_namespace, stored_namespace
from common.kv_store.block_keys import block_key, block_keys, root_key
from common.kv_store.file_store import FileBlockStore
from common.kv_store.fingerprint import adapter_identity
from common.kv_store.store import BlockError

TOKENS = list(range(100, 116))


def _block(seed: int, n: int = 4096):
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(0, 500, len(TOKENS))]
    key = block_key(root_key(0), tokens)
    return key, tokens, {"l0.p0": rng.integers(0, 255, n, dtype=np.uint8)}


def _file(store: FileBlockStore, key: str):
    return store.dir / "blocks" / key[:2] / f"{key}.safetensors"


def test_keys_chain_over_parents_and_namespaces():
    tokens = list(range(40))
    keys = block_keys(tokens, 0, 16)
    assert len(keys) == 2  # the 8-token tail has no key
    assert keys[1] == block_key(keys[0], tokens[16:32])
    assert block_keys(tokens, 7, 16)[0] != keys[0]  # a salt's blocks are its own
    assert block_keys([99] + tokens[1:], 0, 16)[1] != keys[1]  # the parent counts


def test_round_trip_and_restart(tmp_path):
    store = FileBlockStore(tmp_path, "fp1", budget=1 << 20)
    key, tokens, arrays = _block(0)
    assert store.put(key, root_key(0), tokens, arrays)
    got = store.get(key)
    assert got.tokens == tokens and np.array_equal(got.arrays["l0.p0"], arrays["l0.p0"])
    (store.dir / "index.json").unlink()  # rebuilt from the files at the next start
    again = FileBlockStore(tmp_path, "fp1", budget=1 << 20)
    assert again.keys() == [key]
    assert again.usage()[0] == _file(again, key).stat().st_size


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_damaged_block_is_refused_and_forgotten(tmp_path, damage):
    store = FileBlockStore(tmp_path, "fp1", budget=1 << 20)
    key, tokens, arrays = _block(1)
    store.put(key, root_key(0), tokens, arrays)
    path = _file(store, key)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-100] ^= 0x01
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[20] ^= 0x20
    path.write_bytes(bytes(data))
    with pytest.raises(BlockError) as err:
        store.get(key)
    assert err.value.reason in {"checksum", "truncated", "foreign"}
    assert key not in store.keys() and store.take_dropped() == [key]


def test_foreign_block_is_never_used(tmp_path):
    other = FileBlockStore(tmp_path, "other-model", budget=1 << 20)
    key, tokens, arrays = _block(2)
    other.put(key, root_key(0), tokens, arrays)
    mine = FileBlockStore(tmp_path, "fp1", budget=1 << 20)
    assert mine.keys() == []  # another fingerprint's directory is not looked at
    _file(mine, key).parent.mkdir(parents=True)
    _file(mine, key).write_bytes(_file(other, key).read_bytes())  # copied in by hand
    with pytest.raises(BlockError) as err:
        mine.get(key)
    assert err.value.reason == "foreign"


def test_budget_evicts_least_recently_used(tmp_path):
    probe = FileBlockStore(tmp_path / "probe", "fp1", budget=1 << 20)
    key, tokens, arrays = _block(3)
    probe.put(key, root_key(0), tokens, arrays)
    size = probe.usage()[0]
    store = FileBlockStore(tmp_path, "fp1", budget=3 * size + size // 2)
    blocks = [_block(s) for s in range(10, 16)]
    for i, (key, tokens, arrays) in enumerate(blocks):
        assert store.put(key, root_key(0), tokens, arrays)
        if i >= 1:
            store.get(blocks[0][0])  # keeps the first block recently used
        if i >= 2:
            store.touch([blocks[1][0]])  # and the second, used from the pool
        held = sum(f.stat().st_size for f in (store.dir / "blocks").glob("*/*"))
        assert held <= store.budget
    keys = store.keys()
    assert keys == [blocks[-1][0], blocks[0][0], blocks[1][0]]  # least recent first
    assert set(store.take_dropped()) == {k for k, _, _ in blocks} - set(keys)


def test_old_fingerprint_goes_first(tmp_path):
    old = FileBlockStore(tmp_path, "old-model", budget=1 << 20)
    for s in range(4):
        key, tokens, arrays = _block(s, n=8192)
        old.put(key, root_key(0), tokens, arrays)
    FileBlockStore(tmp_path, "fp1", budget=20000)
    assert list((tmp_path / "old-model" / "blocks").glob("*/*")) == []


def test_unwritable_directory_warns_once_and_reads_on(tmp_path, caplog):
    """Writes fail (here: the block's subdirectory is a file; a full or read-only disk
    fails the same way, with OSError): one warning, no more writes, reads go on."""
    store = FileBlockStore(tmp_path, "fp1", budget=1 << 20)
    key, tokens, arrays = _block(4)
    store.put(key, root_key(0), tokens, arrays)
    news = [b for b in map(_block, range(5, 12)) if b[0][:2] != key[:2]][:3]
    for k, _, _ in news:
        (store.dir / "blocks" / k[:2]).write_bytes(b"not a directory")
    with caplog.at_level(logging.WARNING):
        for k, t, a in news:
            assert not store.put(k, root_key(0), t, a)
    warnings = [r for r in caplog.records if "stops writing" in r.getMessage()]
    assert len(warnings) == 1 and not store.writable
    assert store.get(key).tokens == tokens


def test_servers_sharing_a_directory_see_each_others_blocks(tmp_path):
    a = FileBlockStore(tmp_path, "fp1", budget=1 << 20)
    b = FileBlockStore(tmp_path, "fp1", budget=1 << 20)
    key, tokens, arrays = _block(20)
    assert a.put(key, root_key(0), tokens, arrays)
    assert b.keys() == [] and b.rescan() == [key]
    assert b.get(key).tokens == tokens and b.usage()[1] == 1
    _file(a, key).unlink()  # another server's budget took it
    assert b.rescan() == [] and b.keys() == [] and b.take_dropped() == [key]


def test_a_killed_writers_temporary_file_is_never_a_block(tmp_path):
    store = FileBlockStore(tmp_path, "fp1", budget=1 << 20)
    key, tokens, arrays = _block(21)
    store.put(key, root_key(0), tokens, arrays)
    whole = _file(store, key).read_bytes()
    _file(store, key).unlink()
    partial = _file(store, key).with_name(_file(store, key).name + ".tmp.999.1")
    partial.write_bytes(whole[: len(whole) // 2])  # what a SIGKILL mid-write leaves
    again = FileBlockStore(tmp_path, "fp1", budget=1 << 20)
    assert again.keys() == [] and partial.exists()  # young: maybe a live writer's
    os.utime(partial, (0, 0))
    FileBlockStore(tmp_path, "fp1", budget=1 << 20)
    assert not partial.exists()  # old: removed at start-up


def test_an_adapters_namespace_follows_its_files_not_its_place(tmp_path):
    """The disk's namespace of a LoRA adapter: equal for the same files anywhere, apart
    for another adapter's and from the base's (and the base's is the trie's own)."""
    dirs = []
    for name, weights in (("x", b"w1"), ("y", b"w1"), ("z", b"w2")):
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text('{"lora_parameters": {"scale": 2.0}}')
        (d / "adapters.safetensors").write_bytes(weights)
        dirs.append(d)
    x, y, z = (stored_namespace(None, adapter_identity(d)) for d in dirs)
    assert x == y and x != z and 0 not in (x, z)
    assert stored_namespace(None, "") == 0 and stored_namespace("s", "") == salt_namespace("s")
    assert stored_namespace("s", adapter_identity(dirs[0])) not in (x, salt_namespace("s"))


def test_a_block_written_with_the_older_blake2b_checksum_still_reads(tmp_path):
    """Block files from before the XXH3 checksum (an unprefixed blake2b one) are served
    after an upgrade, and a flipped byte in one is still refused."""
    import hashlib
    import json

    from safetensors.numpy import save

    store = FileBlockStore(tmp_path, "fp1", budget=1 << 20)
    key, tokens, arrays = _block(5)
    meta = {"key": key, "parent": root_key(0), "tokens": json.dumps(tokens), "fingerprint": "fp1"}
    digest = hashlib.blake2b(digest_size=16)
    for name in ("key", "parent", "tokens", "fingerprint"):
        digest.update(f"{name}={meta[name]}\0".encode())
    for name in sorted(arrays):
        digest.update(f"{name}:{arrays[name].dtype.str}:{arrays[name].shape}\0".encode())
        digest.update(arrays[name].tobytes())
    path = _file(store, key)
    path.parent.mkdir(parents=True)
    path.write_bytes(save(arrays, metadata={**meta, "checksum": digest.hexdigest()}))
    store = FileBlockStore(tmp_path, "fp1", budget=1 << 20)
    assert np.array_equal(store.get(key).arrays["l0.p0"], arrays["l0.p0"])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(BlockError) as err:
        store.get(key)
    assert err.value.reason == "checksum"
