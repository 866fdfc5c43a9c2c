"""The disk tier's fingerprint: what must be equal for stored KV to be reusable.

It covers the model's files (every file's name and size, and the first MiB of each:
the weights' headers and first tensors, without reading gigabytes at each start), the
tokenizer and config (whole, through the model identity), how the pool stores KV (dtype,
codec, layer layout) and the block size. Everything lives under `DIR/<fingerprint>/`, so
another model's blocks are never even looked at.

A LoRA adapter's KV differs from the base's, but its blocks share the base's directory:
they are keyed in a namespace of the adapter's own (`adapter_identity`, a digest of its
weights and config, never its --lora position or name, which a restart may give to
another adapter), so the base and each adapter only ever meet their own blocks."""

from __future__ import annotations

import hashlib
from pathlib import Path

from common.lora_adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from common.model_identity import model_identity

HEAD_BYTES = 1 << 20
FINGERPRINT_CHARS = 24


def fingerprint(model_dir: str | Path, kv_layout: str, block_tokens: int) -> str:
    """`kv_layout`: a description of the pool's storage that differs whenever the stored
    bytes would (the worker's `repr` of its KVLayout)."""
    root = Path(model_dir)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(model_identity(root).digest.encode())
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(root)}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            digest.update(f.read(HEAD_BYTES))
    digest.update(f"{kv_layout}\0{block_tokens}".encode())
    return digest.hexdigest()[:FINGERPRINT_CHARS]


def adapter_identity(adapter_dir: str | Path) -> str:
    """A LoRA adapter's identity for the disk tier: a digest of its whole weights file and
    its config (an adapter is megabytes, read once at start-up)."""
    root = Path(adapter_dir)
    digest = hashlib.blake2b(digest_size=16)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        digest.update(f"{name}\0".encode())
        with open(root / name, "rb") as f:
            while chunk := f.read(HEAD_BYTES):
                digest.update(chunk)
    return digest.hexdigest()
