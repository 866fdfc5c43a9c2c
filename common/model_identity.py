"""What a replica serves, so a router can refuse one that serves another model.

The identity is the model type, the vocabulary size and a SHA-256 over config.json and
the tokenizer files (names and bytes, in name order). Two replicas that agree on all
three tokenize, template and detokenize alike and run the same architecture. The weights
are not hashed: reading gigabytes at every start would cost seconds on a real model, and
a different model of one architecture practically always differs in its config or
tokenizer; a fine-tune that changed neither passes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from common.messages import ModelIdentity

# Everything that decides how text becomes token ids and back, and the chat template.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def model_identity(model_dir: str | Path) -> ModelIdentity:
    """The identity of the model directory (config.json must exist)."""
    root = Path(model_dir)
    config_bytes = (root / "config.json").read_bytes()
    config = json.loads(config_bytes)
    text = config.get("text_config") or {}
    vocab = config.get("vocab_size", text.get("vocab_size", 0))
    digest = hashlib.sha256()
    for name in ("config.json", *TOKENIZER_FILES):
        path = root / name
        if path.is_file():
            data = path.read_bytes()
            digest.update(f"{name}\0{len(data)}\0".encode())
            digest.update(data)
    return ModelIdentity(str(config.get("model_type", "")), int(vocab), digest.hexdigest())


def describe(identity: ModelIdentity) -> str:
    """`model_type qwen3, vocabulary 512, digest 3f2a9c01b7e4`."""
    return (
        f"model_type {identity.model_type}, vocabulary {identity.vocab_size}, "
        f"digest {identity.digest[:12]}"
    )


def mismatch(mine: ModelIdentity, theirs: ModelIdentity) -> str | None:
    """None when both serve the same model, else what differs, as one phrase."""
    if mine == theirs:
        return None
    return f"it serves {describe(theirs)}; this router serves {describe(mine)}"
