"""What the worker learns about an mlx-lm model before running it: the shape of its KV
(so one pool fits any standard attention) and whether its LM head can be split off (so a
prefill projects only each row's last position to the vocabulary)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from worker_mlx.kv_pool import KVLayout
from worker_mlx.layer_caches import ProbeCache


def split_lm_head(model: nn.Module):
    """(body, head) with head(body(x)) == model(x), so a prefill can project only the last
    position of each row to the vocabulary instead of all of them. Models that do more than
    a plain projection after the body keep (model, identity)."""

    def identity(h):
        return h

    inner = getattr(model, "model", None)
    args = getattr(model, "args", None)
    if inner is None or args is None:
        return model, identity
    if getattr(args, "tie_word_embeddings", False):
        head = inner.embed_tokens.as_linear
    elif hasattr(model, "lm_head"):
        head = model.lm_head
    else:
        return model, identity
    x = mx.array([[1, 2, 3]])
    if not mx.allclose(head(inner(x)), model(x), atol=1e-4).item():
        return model, identity
    return inner, head


def probe_kv_layout(model: nn.Module) -> KVLayout:
    """Run one token through the model with recording caches; raise if it is not standard."""
    layers = model.layers
    probes = [ProbeCache() for _ in layers]
    mx.eval(model(mx.array([[0]]), cache=probes))
    if any(p.shape is None for p in probes):
        raise ValueError("model has layers without a standard KV cache")
    shapes = {(p.shape[1], p.shape[3], p.dtype) for p in probes}
    if len(shapes) != 1:
        raise ValueError(f"layers disagree on KV shape: {shapes}")
    (n_kv_heads, head_dim, dtype) = shapes.pop()
    return KVLayout(len(layers), n_kv_heads, head_dim, dtype)
