"""An image's identity in the token sequence the radix cache keys on (SGLang's pad_value).

The router expands each image into its model's run of placeholder tokens, but in the
sequence it sends, every placeholder of the run is the image's *pad value*: a number
derived from a hash of the image's bytes and placed above the vocabulary. So the trie,
which only compares numbers, matches the same image at the same place and never another
one, with no change to the trie. Collisions with real tokens are impossible: every pad
value is at least the model's vocabulary size, which no real token id reaches; the worker
maps pad values back to the model's placeholder id before embedding (`real_token_ids`).
Two different images share a pad value only if their SHA-256 digests agree modulo about
2**31 (the values stay below 2**31 so that every int32 token array still holds them).
"""

from __future__ import annotations

import hashlib

PAD_CEILING = 2**31 - 1  # token ids travel as int32 arrays in places


def image_hash(data: bytes) -> bytes:
    """The content hash of an image: SHA-256 of its encoded bytes."""
    return hashlib.sha256(data).digest()


def pad_value(digest: bytes, vocab_size: int) -> int:
    """The token id that stands for every placeholder of this image: >= vocab_size."""
    if vocab_size >= PAD_CEILING:
        raise ValueError(f"a vocabulary of {vocab_size} leaves no room for image pad values")
    return vocab_size + int.from_bytes(digest[:8], "big") % (PAD_CEILING - vocab_size)


def is_pad(token_id: int, vocab_size: int) -> bool:
    return token_id >= vocab_size
