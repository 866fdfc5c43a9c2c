"""What the worker learns about an mlx-lm model before running it: what each layer caches
and attends (so one pool fits it), and whether its LM head can be split off (so a
prefill projects only each row's last position to the vocabulary).

What a layer attends is read from the model's own `make_cache()`, the caches mlx-lm
generates with: a `KVCache` attends every earlier token, a `RotatingKVCache(max_size=W)`
the last W, an `ArraysCache` is a recurrent layer's state. Any other cache is a layer
kind the worker does not serve, refused here.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as mlx_cache

from worker_mlx.kv_pool import KVLayout, grouped
from worker_mlx.layer_caches import ProbeCache
from worker_mlx.state_pool import StateLayout


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


RECURRENT = "recurrent"


def layer_kinds(model: nn.Module) -> tuple[list, tuple[int, ...]]:
    """Per cache of the model (its `make_cache()` order, a CacheList's caches in turn):
    the window an attention layer attends (None: all earlier tokens), or RECURRENT; and
    the sizes of the CacheLists, when the model's caches are CacheLists."""
    if not hasattr(model, "make_cache"):
        return [None] * len(model.layers), ()
    caches = model.make_cache()
    groups = ()
    if caches and all(type(c) is mlx_cache.CacheList for c in caches):
        groups = tuple(len(c.caches) for c in caches)
        caches = [sub for c in caches for sub in c.caches]
    kinds = []
    for i, c in enumerate(caches):
        if isinstance(c, mlx_cache.RotatingKVCache) and c.keep == 0:
            kinds.append(c.max_size)
        elif type(c) in (mlx_cache.KVCache, mlx_cache.ConcatenateKVCache):
            kinds.append(None)
        elif type(c) is mlx_cache.ArraysCache:
            kinds.append(RECURRENT)
        else:
            raise UnsupportedModel(f"layer {i} keeps a {type(c).__name__}, which is not served")
    return kinds, groups


def probe_layout(model: nn.Module) -> tuple[KVLayout, StateLayout | None]:
    """Run one token through the model with recording caches: what its KV layers store
    and what its recurrent layers keep. Raise UnsupportedModel if it is not served."""
    kinds, groups = layer_kinds(model)
    recurrent = tuple(i for i, k in enumerate(kinds) if k is RECURRENT)
    if len(recurrent) == len(kinds):
        raise UnsupportedModel("it has no attention layer (a pure recurrent model)")
    caches = [mlx_cache.ArraysCache(size=2) if k is RECURRENT else ProbeCache() for k in kinds]
    try:
        mx.eval(model(mx.array([[0]]), cache=grouped(caches, groups)))
    except (AttributeError, TypeError, IndexError) as exc:
        raise UnsupportedModel(f"its layers use their caches in a way not served ({exc})") from exc
    probes = [c for c in caches if isinstance(c, ProbeCache)]
    if any(p.shape is None for p in probes):
        raise UnsupportedModel("it has attention layers that keep no keys and values")
    shapes = {(p.shape[1], p.dtype) for p in probes}
    if len(shapes) != 1:
        raise UnsupportedModel(f"its layers disagree on the KV heads or dtype: {shapes}")
    (n_kv_heads, dtype) = shapes.pop()
    widths = tuple((p.shape[3], p.v_dim) for p in probes)
    head_dim, v_dim = widths[0]
    windows = tuple(k for k in kinds if k is not RECURRENT)
    kv = KVLayout(
        len(probes), n_kv_heads, head_dim, dtype,
        v_head_dim=None if v_dim == head_dim else v_dim,
        windows=windows if any(w is not None for w in windows) else (),
        recurrent=recurrent,
        layer_widths=widths if len(set(widths)) > 1 else (),
        groups=groups,
    )  # fmt: skip
    states = [caches[i] for i in recurrent]
    if not states:
        return kv, None
    if any(a is None for c in states for a in c.cache):
        raise UnsupportedModel("it has recurrent layers that keep no state")
    entries = tuple(tuple((tuple(a.shape[1:]), a.dtype) for a in c.cache) for c in states)
    return kv, StateLayout(entries)


def probe_kv_layout(model: nn.Module) -> KVLayout:
    return probe_layout(model)[0]
