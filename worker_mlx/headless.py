"""Embedding checkpoints that mlx-lm's own load refuses: the body alone, as transformers'
AutoModel saves it (Qwen3-Embedding's: no `model.` prefix on the weights, and no LM head
in the 4B and 8B ones, whose config says the head is not tied).

They load with mlx-lm's classes and its `load_model`, through a sanitize that puts the
prefix back and, when the head is missing, lets it read the embedding matrix (the same
arrays: no memory) so that the model runs as its class expects (the worker's start-up
probe and self-check run it). Such a model serves embeddings only: its `headless`
attribute is set, the worker reports it (`WorkerReady.generates`) and the scheduler
refuses generation with a 400. A body-only checkpoint whose config ties the head to the
embeddings (Qwen3-Embedding-0.6B's) has its head: it generates too.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger("worker")

_HEAD_PARTS = ("weight", "scales", "biases")  # a quantized head's too


def load_headless(path: str, lazy: bool = False):
    """(model, tokenizer, config) of a body-only checkpoint at the local directory
    `path`, or None when it is not one (its weights have the prefix and the head)."""
    from mlx_lm.utils import _get_classes, load_model, load_tokenizer

    def classes(config: dict):
        model_class, args_class = _get_classes(config=config)
        return _with_body_sanitize(model_class), args_class

    try:
        model, config = load_model(Path(path), lazy, get_model_classes=classes)
    except Exception as exc:
        logger.debug("not a body-only checkpoint either: %s", exc)
        return None
    if not (model.body_only or model.headless):
        return None  # mlx-lm's load failed for another reason: report that one
    tokenizer = load_tokenizer(Path(path), eos_token_ids=config.get("eos_token_id"))
    if model.headless:
        logger.info("%s: body-only weights, no LM head: embeddings only", path)
    else:
        logger.info("%s: body-only weights, the head tied to the embeddings", path)
    return model, tokenizer, config


def _with_body_sanitize(model_class: type) -> type:
    def sanitize(self, weights: dict) -> dict:
        self.body_only = self.headless = False
        if hasattr(self, "model") and not any(k.startswith("model.") for k in weights):
            weights = {_prefixed(k): v for k, v in weights.items()}
            self.body_only = True
        weights = (
            model_class.sanitize(self, weights) if hasattr(model_class, "sanitize") else weights
        )
        if hasattr(self, "lm_head") and "lm_head.weight" not in weights:
            for part in _HEAD_PARTS:
                if f"model.embed_tokens.{part}" in weights:
                    weights[f"lm_head.{part}"] = weights[f"model.embed_tokens.{part}"]
            self.headless = True
        return weights

    # the module stays mlx-lm's: the CPU backend finds the files to patch by it
    body = {"sanitize": sanitize, "__module__": model_class.__module__}
    return type(model_class.__name__, (model_class,), body)


def _prefixed(key: str) -> str:
    return key if key.startswith("lm_head.") else f"model.{key}"
