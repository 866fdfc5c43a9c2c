"""Incremental detokenization that never emits half a UTF-8 character."""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window of recent tokens, so each step costs O(window) rather than
    O(sequence); text ending in U+FFFD is held back until the next token completes it.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly complete text."""
        self.ids.extend(token_ids)
        decode = self.tokenizer.decode
        prefix_text = decode(
            self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip
        )
        new_text = decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character decodes as U+FFFD)."""
        full = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        return delta
