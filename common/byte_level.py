"""Byte-level BPE (GPT-2's scheme, used by Qwen, Llama 3 and the tiny models): every
byte has a printable symbol, and a token's symbols spell its exact bytes."""

from __future__ import annotations

import json


def is_byte_level(tokenizer) -> bool:
    try:
        decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    except Exception:  # a slow tokenizer, or an unusual one
        return False
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any((d or {}).get("type") == "ByteLevel" for d in parts)


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: printable symbol -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in keep:
            symbols[chr(b)] = b
        else:
            symbols[chr(256 + extra)] = b
            extra += 1
    return symbols
