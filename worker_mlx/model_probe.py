"""What the worker learns about an mlx-lm model before running it: what each layer caches
and attends (so one pool fits it), and whether its LM head can be split off (so a
prefill projects only each row's last position to the vocabulary).

What a layer attends is read from the model's own `make_cache()`, the caches mlx-lm
generates with: a `KVCache` attends every earlier token, a `RotatingKVCache(max_size=W)`
the last W. Any other cache is a layer kind the worker does not serve, refused here.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as mlx_cache

from worker_mlx.kv_pool import KVLayout
from worker_mlx.layer_caches import ProbeCache


class UnsupportedModel(ValueError):
    """A model the worker cannot serve exactly; the message names what it found."""


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


def layer_windows(model: nn.Module) -> tuple[int | None, ...]:
    """Per layer, the window it attends (None: all earlier tokens), from `make_cache()`."""
    if not hasattr(model, "make_cache"):
        return (None,) * len(model.layers)
    windows = []
    for i, c in enumerate(model.make_cache()):
        if isinstance(c, mlx_cache.RotatingKVCache) and c.keep == 0:
            windows.append(c.max_size)
        elif type(c) in (mlx_cache.KVCache, mlx_cache.ConcatenateKVCache):
            windows.append(None)
        else:
            raise UnsupportedModel(f"layer {i} keeps a {type(c).__name__}, which is not served")
    return tuple(windows)


def probe_kv_layout(model: nn.Module) -> KVLayout:
    """Run one token through the model with recording caches; raise if it is not standard."""
    windows = layer_windows(model)
    probes = [ProbeCache() for _ in windows]
    try:
        mx.eval(model(mx.array([[0]]), cache=probes))
    except (AttributeError, TypeError, IndexError) as exc:
        raise UnsupportedModel(f"its layers use their caches in a way not served ({exc})") from exc
    if any(p.shape is None for p in probes):
        raise UnsupportedModel("it has layers without a key/value cache")
    shapes = {(p.shape[1], p.shape[3], p.v_dim, p.dtype) for p in probes}
    if len(shapes) != 1:
        raise UnsupportedModel(f"its layers disagree on the key/value shape: {shapes}")
    (n_kv_heads, head_dim, v_dim, dtype) = shapes.pop()
    return KVLayout(
        len(probes), n_kv_heads, head_dim, dtype,
        v_head_dim=None if v_dim == head_dim else v_dim,
        windows=windows if any(w is not None for w in windows) else (),
    )  # fmt: skip
