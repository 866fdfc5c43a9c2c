"""Signatures of the thinking blocks the Anthropic Messages API returns: an HMAC-SHA256 of
the thinking text under a key kept in a file of this user's (drawn on first use), so the
blocks of an agent's history stay valid when the server restarts. Anthropic's SDK expects
the field, and an agent sends the blocks back in its history: like Anthropic's API, a
thinking block whose signature this server did not make (edited text, another machine's
block) is refused with a 400 rather than trusted.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import secrets
from pathlib import Path

logger = logging.getLogger("router")
KEY_BYTES = 32


def key_path() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(state) / "radix-mlx" / "thinking-signature.key"


def stored_key(path: Path) -> bytes:
    """The key in `path`, made (readable by this user only) if there is none; a fresh
    key for this run alone when the file cannot be read or written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(KEY_BYTES))
    except FileExistsError:
        pass
    except OSError as exc:
        logger.warning("thinking signatures last this run only: %s", exc)
        return secrets.token_bytes(KEY_BYTES)
    key = path.read_bytes()
    if len(key) != KEY_BYTES:  # a half-written file of a concurrent first start
        logger.warning("thinking signatures last this run only: %s is not a key", path)
        return secrets.token_bytes(KEY_BYTES)
    return key


class ThinkingSigner:
    def __init__(self, key: bytes | None = None):
        self.key = key or stored_key(key_path())

    def sign(self, thinking: str) -> str:
        digest = hmac.new(self.key, thinking.encode("utf-8"), hashlib.sha256).digest()
        return base64.b64encode(digest).decode("ascii")

    def valid(self, thinking, signature) -> bool:
        if not isinstance(thinking, str) or not isinstance(signature, str):
            return False
        return hmac.compare_digest(self.sign(thinking), signature)
