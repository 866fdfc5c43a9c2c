"""Signatures of the thinking blocks the Anthropic Messages API returns: an HMAC-SHA256 of
the thinking text under a key this server draws at start-up. Anthropic's SDK expects the
field, and an agent sends the blocks back in its history: like Anthropic's API, a thinking
block whose signature this server did not make (edited text, another server's or an older
run's block) is refused with a 400 rather than trusted.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets


class ThinkingSigner:
    def __init__(self, key: bytes | None = None):
        self.key = key or secrets.token_bytes(32)

    def sign(self, thinking: str) -> str:
        digest = hmac.new(self.key, thinking.encode("utf-8"), hashlib.sha256).digest()
        return base64.b64encode(digest).decode("ascii")

    def valid(self, thinking, signature) -> bool:
        if not isinstance(thinking, str) or not isinstance(signature, str):
            return False
        return hmac.compare_digest(self.sign(thinking), signature)
