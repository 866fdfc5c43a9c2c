"""Cache salts: tenants share prefix-cached KV only when they send the same salt.

A request may carry vLLM's `cache_salt` (a string; or a gateway sets it in a header,
`--cache-salt-header`). A shared prefix cache answers a prompt that starts like another
tenant's faster, which tells the second tenant what the first one sent (a timing side
channel); a salt puts a tenant's prompts in a namespace of their own.

The scheduler's trie and the router's guess of it (`router/replicas/approx_tree.py`) both key a
salted prompt as `[namespace] + tokens`, the namespace a negative int made from the salt:
token ids are never negative, so no unsalted prompt and no other salt can share even its
first edge, and the trie stays keyed by ints (the evicted paths the scheduler reports to
the router are lists of ints on the wire). Two salts meet only if their 62-bit hashes
collide.
"""

from __future__ import annotations

import hashlib

MAX_CACHE_SALT_CHARS = 1024  # a salt is an id or a key's digest, not a document


def salt_namespace(salt: str | None) -> int:
    """The trie's namespace key of `salt`: 0 (the shared, unsalted cache) for none or
    "", else a negative int."""
    return cache_namespace(salt, 0)


def cache_namespace(salt: str | None, lora: int) -> int:
    """The namespace of a request under `salt` running LoRA adapter `lora` (0: none): a
    request's KV depends on its adapter, so prefixes are shared within one adapter and
    salt only. 0 for neither, else a negative int."""
    if not salt and not lora:
        return 0
    key = (salt or "").encode("utf-8")
    if lora:  # 0xff never occurs in UTF-8: no salt's bytes spell an adapter's namespace
        key += b"\xfflora" + str(lora).encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return -1 - (int.from_bytes(digest, "big") >> 2)  # in [-2**62, -1]: a msgpack int64


def stored_namespace(salt: str | None, adapter: str) -> int:
    """The namespace of the disk tier's block keys (common/kv_store/block_keys.py): as
    `cache_namespace`, with the adapter named by its identity (`adapter_identity`, ""
    for the base) rather than its --lora position, which a restart may give to another
    adapter. Equal to `cache_namespace` without an adapter."""
    if not adapter:
        return cache_namespace(salt, 0)
    key = (salt or "").encode("utf-8") + b"\xffadapter" + adapter.encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return -1 - (int.from_bytes(digest, "big") >> 2)


def salted_key(tokens: list[int], salt: str | None, lora: int = 0) -> list[int]:
    """The radix key of a prompt under `salt` and adapter `lora`: the tokens, behind their
    namespace key."""
    return namespaced_key(tokens, cache_namespace(salt, lora))


def namespaced_key(tokens: list[int], namespace: int) -> list[int]:
    return [namespace, *tokens] if namespace else tokens


def salt_problem(salt: object) -> str | None:
    """What is wrong with a request's `cache_salt`, or None if it is fine (None is)."""
    if salt is None:
        return None
    if not isinstance(salt, str):
        return f"cache_salt must be a string, not {type(salt).__name__}"
    if not salt:
        return "cache_salt must be a non-empty string"
    if len(salt) > MAX_CACHE_SALT_CHARS:
        return f"cache_salt is {len(salt)} characters long; the limit is {MAX_CACHE_SALT_CHARS}"
    return None
