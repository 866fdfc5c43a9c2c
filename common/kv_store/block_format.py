"""A block file's bytes: the safetensors layout, read without copying, and its checksum.

The reader thread parses every block it loads, so both halves stay off the copy path:
the arrays are numpy views into the file's bytes (`parse`), and the checksum is XXH3-128
over the metadata and those views (`checksum`), about 20 GB/s where blake2b does under 1:
a block of a small model is 256 KiB, a long session's load is gigabytes. It guards
against damage (a flipped byte, a torn write), not an adversary: which KV a block holds
is decided by its key and the fingerprint, both checked besides. Files written before
carry an unprefixed blake2b checksum, still accepted (`matches`).
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import xxhash

# safetensors dtype names -> numpy (a block's parts are uint8; the rest for any store user)
DTYPES = {
    "BOOL": "?", "U8": "u1", "I8": "i1", "U16": "<u2", "I16": "<i2", "F16": "<f2",
    "U32": "<u4", "I32": "<i4", "F32": "<f4", "U64": "<u8", "I64": "<i8", "F64": "<f8",
}  # fmt: skip
META_FIELDS = ("key", "parent", "tokens", "fingerprint")
PREFIX = "xxh3:"


def parse(data: bytes) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """The header's `__metadata__` and the arrays, as read-only views into `data`;
    ValueError (or KeyError, TypeError) when the header or an offset does not fit."""
    if len(data) < 8:
        raise ValueError("shorter than a header")
    n = int.from_bytes(data[:8], "little")
    if n <= 0 or 8 + n > len(data):
        raise ValueError("header length beyond the file")
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", None) or {}
    body = memoryview(data)[8 + n :]
    arrays = {}
    for name, info in header.items():
        dtype = np.dtype(DTYPES[info["dtype"]])
        shape = tuple(int(d) for d in info["shape"])
        start, end = (int(x) for x in info["data_offsets"])
        count = math.prod(shape)
        if not 0 <= start <= end <= len(body) or end - start != count * dtype.itemsize:
            raise ValueError(f"array {name}: its bytes are not in the file")
        arrays[name] = np.frombuffer(body, dtype, count, start).reshape(shape)
    return meta, arrays


def checksum(meta: dict[str, str], arrays: dict[str, np.ndarray]) -> str:
    """What a new block file's metadata carries as `checksum`."""
    digest = xxhash.xxh3_128()
    _feed(digest, meta, arrays)
    return PREFIX + digest.hexdigest()


def matches(meta: dict[str, str], arrays: dict[str, np.ndarray]) -> bool:
    """Whether the stored checksum is that of the metadata and arrays read."""
    stored = meta.get("checksum")
    if not isinstance(stored, str):
        return False
    if stored.startswith(PREFIX):
        return stored == checksum(meta, arrays)
    digest = hashlib.blake2b(digest_size=16)  # a file written before XXH3
    _feed(digest, meta, arrays)
    return stored == digest.hexdigest()


def _feed(digest, meta: dict[str, str], arrays: dict[str, np.ndarray]) -> None:
    for name in META_FIELDS:
        digest.update(f"{name}={meta.get(name)}\0".encode())
    for name in sorted(arrays):
        arr = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}:{arr.dtype.str}:{arr.shape}\0".encode())
        digest.update(arr.reshape(-1).view(np.uint8))  # the bytes, not a copy of them
