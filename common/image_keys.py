"""An image's identity in the token sequence the radix cache keys on (SGLang's pad_value).

The router expands each image into its model's run of placeholder tokens, but in the
sequence it sends, the placeholders of the run are the image's *pad values*: numbers
derived from a hash of the image's bytes and placed above the vocabulary. So the trie,
which only compares numbers, matches the same image at the same place and never another
one, with no change to the trie.

- Collisions with real tokens are impossible: every pad value is at least the model's
  vocabulary size, which no real token id reaches; the worker maps pad values back to the
  model's placeholder id before embedding, and the router refuses any other id at or
  above the vocabulary.
- Collisions between images are as unlikely as the hash allows: position k of a run gets
  its own 31-bit slice of a SHAKE-256 stream seeded by the image's SHA-256 digest (and k's
  block), so two different images agree on a whole run of n tokens with probability about
  2**(-31 n) (n >= 9: below SHA-256's own 2**-256), not 2**-31. The values stay below
  2**31 so that every int32 token array still holds them.
"""

from __future__ import annotations

import hashlib

import numpy as np

PAD_CEILING = 2**31 - 1  # token ids travel as int32 arrays in places


def image_hash(data: bytes) -> bytes:
    """The content hash of an image: SHA-256 of its encoded bytes."""
    return hashlib.sha256(data).digest()


def pad_values(digest: bytes, vocab_size: int, n: int) -> list[int]:
    """The token ids that stand for the n placeholders of this image's run, each >=
    vocab_size, position k from bytes 8k..8k+8 of SHAKE-256(digest)."""
    if vocab_size >= PAD_CEILING:
        raise ValueError(f"a vocabulary of {vocab_size} leaves no room for image pad values")
    stream = np.frombuffer(hashlib.shake_256(digest).digest(8 * n), dtype=">u8")
    return (vocab_size + stream % np.uint64(PAD_CEILING - vocab_size)).astype(int).tolist()


def pad_value(digest: bytes, vocab_size: int) -> int:
    """The first pad value of this image's run."""
    return pad_values(digest, vocab_size, 1)[0]


def is_pad(token_id: int, vocab_size: int) -> bool:
    return token_id >= vocab_size


def stray_pads(ids: list[int], offset: int, images, vocab_size: int) -> bool:
    """Whether `ids` (a prompt's tokens from index `offset` on) hold an id at or above the
    vocabulary outside every image's run (`images`: ImageParts)."""
    runs = [(im.start, im.start + im.length) for im in images]
    return any(
        t >= vocab_size and not any(a <= offset + k < b for a, b in runs) for k, t in enumerate(ids)
    )


def run_ids(ids: list[int], images) -> set[int]:
    """The pad values of the images' runs in the prompt `ids`."""
    return {t for im in images for t in ids[im.start : im.start + im.length]}
