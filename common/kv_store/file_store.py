"""FileBlockStore: the disk tier's file backend.

Layout under `DIR/<fingerprint>/`: `blocks/<key[:2]>/<key>.safetensors`, one block
each, and `index.json` (every block's size and last use, for the LRU), written now and
then and rebuilt from a scan of `blocks/` at start-up when missing or unreadable; the
scan is what counts, so a block another server wrote into the same directory is found
at the next start.

A block file holds the block's arrays as raw bytes (any dtype: a quantized pool's codes,
bfloat16, which numpy lacks) with, in the safetensors metadata, its key, parent key,
tokens, the fingerprint and a checksum over all of it (`block_format`: XXH3, read
without copying the arrays). A read checks all of it:
a truncated, corrupted or foreign file is refused (`BlockError`) and never served.
Writes go to a temporary file renamed into place, so a kill mid-write leaves no file
that reads as a block. When the directory cannot be written (full, read-only), the
store logs one warning and stops writing; reads go on.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
from safetensors.numpy import save

from common.kv_store import block_format
from common.kv_store.block_keys import block_key
from common.kv_store.store import BlockError, StoredBlock

logger = logging.getLogger(__name__)

SUFFIX = ".safetensors"
INDEX = "index.json"
STALE_TEMP_SECONDS = 60  # a temporary file this old belongs to a writer that died


class FileBlockStore:
    """`BlockStore` over a directory; safe for one writer thread and one reader thread."""

    def __init__(self, root: str | Path, fingerprint: str, budget: int, part: str = ""):
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.dir = self.root / fingerprint
        self.budget = budget
        self.part = part  # "" or a rank's part of each block (its files' extra suffix)
        self._suffix = f".{part}{SUFFIX}" if part else SUFFIX
        self._index = f"index.{part}.json" if part else INDEX
        self._file_print = f"{fingerprint}.{part}" if part else fingerprint
        self.writable = True
        self._lock = threading.Lock()
        self._blocks: OrderedDict[str, int] = OrderedDict()  # key -> bytes, LRU first
        self._bytes = 0
        self.dropped: list[str] = []  # keys evicted for the budget since the last take
        self._open()

    # ------------------------------------------------------------ start-up

    def _open(self) -> None:
        try:
            (self.dir / "blocks").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._stop_writing(exc)
        found = self._scan()
        order = self._read_index()
        if order is None and found:
            logger.info("kv disk: index missing, rebuilt from %d block files", len(found))
        ranks = {k: i for i, k in enumerate(order or [])}
        for key in sorted(found, key=lambda k: (ranks.get(k, -1), found[k][1])):
            self._blocks[key] = found[key][0]
        self._bytes = sum(self._blocks.values())
        self._evict_foreign()
        with self._lock:
            self._fit(0)
        self.save_index()

    def _scan(self) -> dict[str, tuple[int, float]]:
        """key -> (bytes, mtime) of every block file; stale temporary files are removed."""
        found = {}
        now = time.time()
        for path in (self.dir / "blocks").glob("*/*"):
            try:
                st = path.stat()
            except OSError:
                continue
            if path.name.endswith(SUFFIX):
                key = path.name[: -len(self._suffix)]
                if path.name.endswith(self._suffix) and "." not in key:  # not another part's
                    found[key] = (st.st_size, st.st_mtime)
            elif now - st.st_mtime > STALE_TEMP_SECONDS:
                path.unlink(missing_ok=True)
        return found

    def _read_index(self) -> list[str] | None:
        try:
            return list(json.loads((self.dir / self._index).read_text())["lru"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _evict_foreign(self) -> None:
        """Other fingerprints' directories (another model, dtype or layout) go first, the
        oldest first, while everything under the root exceeds the budget."""
        others = []
        for d in self.root.iterdir() if self.root.is_dir() else []:
            if d.is_dir() and d.name != self.fingerprint and (d / "blocks").is_dir():
                size = sum(f.stat().st_size for f in (d / "blocks").glob("*/*"))
                others.append((d.stat().st_mtime, size, d))
        total = self._bytes + sum(size for _, size, _ in others)
        for _, size, d in sorted(others):
            if total <= self.budget:
                return
            logger.info("kv disk: removing %s (another model's blocks) for the budget", d.name)
            for f in (d / "blocks").glob("*/*"):
                f.unlink(missing_ok=True)
            total -= size

    # ------------------------------------------------------------ the interface

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._blocks)

    def usage(self) -> tuple[int, int]:
        """(bytes, blocks) held."""
        with self._lock:
            return self._bytes, len(self._blocks)

    def take_dropped(self) -> list[str]:
        with self._lock:
            out, self.dropped = self.dropped, []
            return out

    def put(self, key: str, parent: str, tokens: list[int], arrays: dict[str, np.ndarray]) -> bool:
        """Store a block (False: not stored, the tier does not write). A block already
        held is only marked used."""
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return True
        if not self.writable:
            return False
        data = save(arrays, metadata=self._metadata(key, parent, tokens, arrays))
        with self._lock:
            if len(data) > self.budget:
                return False
            self._fit(len(data))
        path = self._path(key)
        temp = path.with_name(f"{path.name}.tmp.{os.getpid()}.{threading.get_ident()}")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(temp, "wb") as f:
                f.write(data)
            os.replace(temp, path)  # atomic: readers see the whole file or none
        except OSError as exc:
            _remove(temp)
            self._stop_writing(exc)
            return False
        with self._lock:
            self._blocks[key] = len(data)
            self._bytes += len(data)
        return True

    def touch(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                if key in self._blocks:
                    self._blocks.move_to_end(key)

    def get(self, key: str) -> StoredBlock:
        """The block, checked; BlockError(reason) when it is missing, truncated,
        corrupted or another model's."""
        try:
            data = self._path(key).read_bytes()
        except OSError as exc:
            self._forget(key)
            raise BlockError("missing", f"block {key}: {exc}") from exc
        try:
            block = self._check(key, data)
        except BlockError:
            self._forget(key, unlink=True)
            raise
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
        return block

    def rescan(self) -> list[str]:
        """Catch up with other servers sharing the directory: blocks they wrote are
        added (as most recently used), blocks gone from it forgotten; the budget then
        covers them all. Returns the added keys."""
        found = self._scan()
        with self._lock:
            added = sorted((k for k in found if k not in self._blocks), key=lambda k: found[k][1])
            for key in [k for k in self._blocks if k not in found]:
                self._bytes -= self._blocks.pop(key)
                self.dropped.append(key)
            for key in added:
                self._blocks[key] = found[key][0]
                self._bytes += found[key][0]
            self._fit(0)
        return added

    def save_index(self) -> None:
        """Write the LRU order (best effort: the scan at start-up is what counts)."""
        if not self.writable:
            return
        with self._lock:
            text = json.dumps({"lru": list(self._blocks)})
        temp = self.dir / f"{self._index}.tmp.{os.getpid()}"
        try:
            temp.write_text(text)
            os.replace(temp, self.dir / self._index)
        except OSError as exc:
            self._stop_writing(exc)

    def part_path(self, key: str, part: str) -> Path:
        """Where another part of block `key` lives (a distributed worker's other rank)."""
        return self.dir / "blocks" / key[:2] / f"{key}.{part}{SUFFIX}"

    def forget(self, key: str) -> None:
        """Drop a block that cannot be served (reported as dropped; its file removed)."""
        self._forget(key, unlink=True)

    # ------------------------------------------------------------ inside

    def _path(self, key: str) -> Path:
        return self.dir / "blocks" / key[:2] / f"{key}{self._suffix}"

    def _metadata(self, key, parent, tokens, arrays) -> dict[str, str]:
        meta = {
            "key": key,
            "parent": parent,
            "tokens": json.dumps(tokens),
            "fingerprint": self._file_print,
        }
        meta["checksum"] = block_format.checksum(meta, arrays)
        return meta

    def _check(self, key: str, data: bytes) -> StoredBlock:
        try:
            meta, arrays = block_format.parse(data)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise BlockError("truncated", f"block {key}: unreadable ({exc})") from exc
        if meta.get("fingerprint") != self._file_print or meta.get("key") != key:
            raise BlockError("foreign", f"block {key}: written for another model or key")
        if not block_format.matches(meta, arrays):
            raise BlockError("checksum", f"block {key}: checksum mismatch")
        tokens = json.loads(meta["tokens"])
        if block_key(meta["parent"], tokens) != key:
            raise BlockError("checksum", f"block {key}: tokens do not hash to the key")
        return StoredBlock(key, meta["parent"], tokens, arrays)

    def _fit(self, incoming: int) -> None:
        """Evict least recently used blocks until `incoming` more bytes fit the budget
        (under the lock)."""
        while self._blocks and self._bytes + incoming > self.budget:
            key, size = self._blocks.popitem(last=False)
            self._bytes -= size
            self.dropped.append(key)
            self._path(key).unlink(missing_ok=True)

    def _forget(self, key: str, unlink: bool = False) -> None:
        with self._lock:
            size = self._blocks.pop(key, None)
            if size is not None:
                self._bytes -= size
                self.dropped.append(key)
        if unlink and self.writable:
            _remove(self._path(key))

    def _stop_writing(self, exc: OSError) -> None:
        if self.writable:
            logger.warning(
                "kv disk: cannot write under %s (%s); the tier stops writing", self.dir, exc
            )
        self.writable = False


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass  # an unwritable directory: the block stays, refused at every read
