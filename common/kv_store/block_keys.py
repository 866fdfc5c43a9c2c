"""Block keys: a prompt cut into blocks of `block_tokens` tokens, each keyed by a hash
chained over its parent block's key and its own tokens (as vLLM, oMLX and LM Studio key
theirs). A key thus names a whole prefix, so two servers, or a restarted one, agree on
what a block holds without sharing anything but the directory."""

from __future__ import annotations

import hashlib
from array import array

DEFAULT_BLOCK_TOKENS = 256
KEY_BYTES = 16  # blake2b digest size: 128 bits, collisions out of reach


def root_key(namespace: int) -> str:
    """The parent of a namespace's first block: a cache salt's blocks never chain into
    another salt's (common/cache_salt.py)."""
    return hashlib.blake2b(b"root:%d" % namespace, digest_size=KEY_BYTES).hexdigest()


def block_key(parent: str, tokens: list[int]) -> str:
    digest = hashlib.blake2b(bytes.fromhex(parent), digest_size=KEY_BYTES)
    digest.update(array("q", tokens).tobytes())
    return digest.hexdigest()


def block_keys(tokens: list[int], namespace: int, block_tokens: int) -> list[str]:
    """The key of every whole block of `tokens`, in order (a tail shorter than a block
    has none)."""
    keys, parent = [], root_key(namespace)
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        parent = block_key(parent, tokens[start : start + block_tokens])
        keys.append(parent)
    return keys


def state_key(key: str) -> str:
    """Where a recurrent model stores its state after block `key`: an entry of its own,
    chained to the block with no tokens (so the store's check that an entry's tokens hash
    to its key holds), which never equals a block's key."""
    return block_key(key, [])


WINDOW_MARK = -1  # no token id: a window entry's one "token"


def window_key(key: str) -> str:
    """Where a sliding-window model stores the sliding layers' KV of block `key` (the
    block's own entry holds its full-attention layers'): an entry of its own, chained to
    the block, stored only for blocks a later prompt's window can reach."""
    return block_key(key, [WINDOW_MARK])
