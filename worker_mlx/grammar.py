"""Constrained decoding on the worker: one llguidance matcher per constrained request.

Each step, the rows of constrained requests get a token mask (the tokens their grammar
allows next) applied to their logits before sampling, in the same batch as unconstrained
rows, which are left untouched; each sampled token then advances its matcher. The masks
are computed on the CPU while the model's step is still running (the caller starts its
evaluation first), so their cost hides behind the step where the device allows.
"""

from __future__ import annotations

import json
import logging

import llguidance
import llguidance.numpy as llg_np
import mlx.core as mx
import numpy as np

from common.byte_level import byte_level_alphabet, is_byte_level
from common.grammar_spec import to_llguidance
from common.messages import SamplingParams

logger = logging.getLogger("worker")

_BITS = mx.arange(32, dtype=mx.uint32)


class Grammars:
    """Matchers for one tokenizer, whose llguidance view is built on first use."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size  # the model's logits, maybe more than the tokenizer's
        self.eos_token_ids = eos_token_ids
        self._lltok = None

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        if self._lltok is None:
            self._lltok = llguidance.LLTokenizer(
                _text_added_tokens(self.hf_tokenizer),
                n_vocab=self.vocab_size,
                eos_token=self.eos_token_ids,
            )
        return self._lltok

    def matcher(self, p: SamplingParams, replay: list[int]) -> llguidance.LLMatcher | None:
        """The request's matcher, advanced past the tokens it already generated (a
        retracted request resuming); None for an unconstrained request."""
        if not p.grammar_kind:
            return None
        m = llguidance.LLMatcher(self.lltokenizer, to_llguidance(p.grammar_kind, p.grammar))
        if m.is_error():
            raise ValueError(f"grammar rejected by the worker: {m.get_error()}")
        if replay:
            m.consume_tokens(replay)
        return m

    def constrain(self, logits: mx.array, matchers: list) -> mx.array:
        """`logits` (B, V) with every constrained row's disallowed tokens at -inf."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits
        bitmask = llg_np.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i in rows:
            m = matchers[i]
            llg_np.fill_next_token_bitmask(m, bitmask, i)
            if m.is_error() or not bitmask[i].any():  # nothing left to allow: end it
                logger.warning("grammar stuck (%s); ending the request", m.get_error())
                words = bitmask.view(np.uint32)
                words[i] = 0
                for t in self.eos_token_ids:
                    words[i, t // 32] |= np.uint32(1 << (t % 32))
        words = mx.array(bitmask.view(np.uint32))
        allowed = ((words[:, :, None] >> _BITS) & 1).reshape(len(matchers), -1)
        allowed = allowed[:, : logits.shape[-1]].astype(mx.bool_)
        return mx.where(allowed, logits, float("-inf"))


def _text_added_tokens(hf_tokenizer) -> str:
    """The tokenizer as llguidance loads it (its HF JSON), with the added tokens that are
    text moved into the BPE vocabulary as the bytes they spell. llguidance takes every
    added token for a special one, so Qwen's `<think>` or `<tool_call>` (plain text to its
    tokenizer) could never match a grammar's text: a grammar that forced `</think>` chose
    that token and then rejected it."""
    data = json.loads(hf_tokenizer.backend_tokenizer.to_str())
    if data["model"].get("type") != "BPE" or not is_byte_level(hf_tokenizer):
        return json.dumps(data)
    symbol_of = {b: ch for ch, b in byte_level_alphabet().items()}
    special = []
    for token in data.get("added_tokens", []):
        if token.get("special", True):
            special.append(token)
        else:
            symbols = "".join(symbol_of[b] for b in token["content"].encode("utf-8"))
            data["model"]["vocab"][symbols] = token["id"]
    data["added_tokens"] = special
    return json.dumps(data)


def advance(matchers: list, tokens: list[int]) -> None:
    """Each constrained row's matcher takes the token it sampled."""
    for m, tok in zip(matchers, tokens):
        if m is not None and not m.is_stopped():
            m.consume_token(tok)
