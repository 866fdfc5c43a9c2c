"""Embedding passes: an EmbedBatch's rows through the model's body, pooled, no KV kept.

The embedding of an input is the body's last hidden state (mlx-lm's `model.model(ids)`:
the hidden states after the final norm, before the LM head), pooled over its tokens
(the last token's, Qwen3-Embedding's way, or the mean of all) and L2-normalized as
OpenAI's are, unless the model's sentence-transformers config has no Normalize module.

No cache of the worker is involved: rows are right-padded into one pass with mlx-lm's
causal mask (`cache=None`), so a real token never attends to the padding after it and a
row's result is the same alone or in a batch. A row longer than one prefill pass
(--prefill-step-size) runs alone, in passes over a throwaway mlx-lm cache, so a pass's
attention scores stay as small as a prefill's. The KV pool, the decode buffer and the
ledger are never read or written: an embedding cannot evict or disturb cached prefixes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

logger = logging.getLogger("worker")

POOLINGS = ("last", "mean")
# sentence-transformers' Pooling config keys for the modes we compute
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class Pooling:
    mode: str  # "last" or "mean"
    normalize: bool  # L2-normalize the pooled vector
    source: str  # where the choice came from, for the log


def read_pooling(model_dir: str, override: str | None = None) -> Pooling:
    """The model's pooling: sentence-transformers' `modules.json` and its Pooling module's
    config when present (a Normalize module present or not decides the normalization),
    else last-token pooling, normalized (a decoder LM's, as Qwen3-Embedding's). `override`
    (--pooling) replaces the mode, never the normalization."""
    modules_file = Path(model_dir) / "modules.json"
    mode, normalize, source = "last", True, "default for a decoder LM"
    if modules_file.is_file():
        modules = json.loads(modules_file.read_text())
        normalize = any(m.get("type") == _ST_NORMALIZE for m in modules)
        source = "sentence-transformers modules.json"
        for m in modules:
            if m.get("type") == _ST_POOLING:
                mode, source = _st_mode(Path(model_dir) / m.get("path", ""), mode), source
    if override is not None:
        mode, source = override, "--pooling"
    return Pooling(mode, normalize, source)


def _st_mode(module_dir: Path, default: str) -> str:
    config_file = module_dir / "config.json"
    if not config_file.is_file():
        return default
    config = json.loads(config_file.read_text())
    chosen = [mode for key, mode in _ST_MODES.items() if config.get(key)]
    if chosen:
        return chosen[0]
    others = sorted(k for k, v in config.items() if k.startswith("pooling_mode") and v)
    logger.warning(
        "the model's pooling (%s) is not one radix-mlx computes; using %s pooling "
        "(--pooling last|mean to choose)",
        ", ".join(others) or "none",
        default,
    )
    return default


def model_body(model):
    """The module that maps token ids to the final normed hidden states, which the LM
    head reads: mlx-lm's `Model.model` (`backbone` in Nemotron-H's and Mamba's; a
    multimodal wrapper's `language_model.model`), or None."""
    for owner in (model, getattr(model, "language_model", None)):
        for name in ("model", "backbone"):
            body = getattr(owner, name, None) if owner is not None else None
            if body is not None and callable(body):
                return body
    return None


class Embedder:
    """Embeds token-id rows with the model's body; `dim` is the embedding width (0: this
    model's body could not be found or does not return hidden states)."""

    def __init__(self, model, pooling: Pooling, prefill_step: int, vocab_size: int):
        self.model, self.pooling, self.prefill_step = model, pooling, prefill_step
        self.body = model_body(model)
        self.dim = self._probe(vocab_size)

    def _probe(self, vocab_size: int) -> int:
        """The body's output width on one token: hidden states, not logits (a body that
        returned the vocabulary's width, or nothing usable, cannot embed)."""
        if self.body is None:
            return 0
        try:
            out = self.body(mx.array([[0]]))
        except Exception as exc:  # a family whose body takes other arguments
            logger.warning("embeddings off: the model's body cannot run alone (%s)", exc)
            return 0
        width = int(out.shape[-1]) if getattr(out, "ndim", 0) == 3 else 0
        if width in (0, vocab_size):
            logger.warning("embeddings off: the model's body returns width %d", width)
            return 0
        return width

    def embed(self, rows: list[list[int]]) -> list[bytes]:
        """Each row's embedding, as little-endian float32 bytes, in row order."""
        if not self.dim:
            raise ValueError("this model cannot embed (its body returns no hidden states)")
        out: list[bytes | None] = [None] * len(rows)
        short = [i for i, ids in enumerate(rows) if len(ids) <= self.prefill_step]
        if short:
            pooled = self._one_pass([rows[i] for i in short])
            for i, vec in zip(short, pooled):
                out[i] = vec
        for i, ids in enumerate(rows):
            if out[i] is None:
                out[i] = self._in_passes(ids)
        return out

    def _one_pass(self, rows: list[list[int]]) -> list[bytes]:
        lengths = [len(ids) for ids in rows]
        width = max(lengths)
        padded = mx.array([ids + [0] * (width - len(ids)) for ids in rows], dtype=mx.int32)
        hidden = self.body(padded).astype(mx.float32)  # (B, L, D)
        lens = mx.array(lengths, dtype=mx.int32)
        if self.pooling.mode == "last":
            pooled = hidden[mx.arange(len(rows)), lens - 1]
        else:
            real = (mx.arange(width)[None, :] < lens[:, None]).astype(mx.float32)
            pooled = (hidden * real[:, :, None]).sum(axis=1) / lens[:, None]
        return self._finish(pooled)

    def _in_passes(self, ids: list[int]) -> bytes:
        """A row longer than one pass: passes of `prefill_step` tokens over a cache made
        for this row alone and dropped after it."""
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        total, last = mx.zeros((self.dim,), dtype=mx.float32), None
        for start in range(0, len(ids), self.prefill_step):
            piece = mx.array([ids[start : start + self.prefill_step]], dtype=mx.int32)
            hidden = self.body(piece, cache=cache)[0].astype(mx.float32)
            total, last = total + hidden.sum(axis=0), hidden[-1]
            mx.eval(total, last)  # each pass's graph is freed before the next is built
        pooled = last if self.pooling.mode == "last" else total / len(ids)
        return self._finish(pooled[None])[0]

    def _finish(self, pooled: mx.array) -> list[bytes]:
        if self.pooling.normalize:
            norm = mx.sqrt((pooled * pooled).sum(axis=-1, keepdims=True))
            pooled = pooled / mx.maximum(norm, 1e-12)  # torch's F.normalize eps
        vectors = np.asarray(pooled, dtype="<f4")
        return [v.tobytes() for v in vectors]


def load_embedder(model_dir: str, model, override: str | None, prefill_step: int,
                  vocab_size: int) -> Embedder:  # fmt: skip
    """The worker's embedder for the model at `model_dir`, its choice logged once."""
    pooling = read_pooling(model_dir, override)
    embedder = Embedder(model, pooling, prefill_step, vocab_size)
    if embedder.dim:
        logger.info(
            "embeddings: %s pooling%s (%s), %d dims",
            pooling.mode, ", L2-normalized" if pooling.normalize else ", not normalized",
            pooling.source, embedder.dim,
        )  # fmt: skip
    return embedder
