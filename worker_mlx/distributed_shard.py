"""Cut a lazily loaded mlx-lm model down to one rank's share, before its weights load.

Tensor parallelism is mlx-lm's own `model.shard(group)` (its sharded linears all_sum
the partial outputs), for the model classes that have it. Pipeline parallelism is
mlx-lm's own `pipeline(group)` where the model's body has it (qwen2, qwen3_moe,
qwen3_5, deepseek, glm4_moe: rank 0 holds the last layers, and the body sends, receives
and gathers the last stage's output itself), and for the classes without it (llama,
qwen3, mistral, ...) the same contiguous split of `model.layers` done here, in rank
order. Either way a rank keeps only its layers (its caches and KV pool follow from
`model.layers`); the first of them receives the hidden states from the previous stage
instead of using its own embedding, the last sends them on, and the last stage's output
is gathered to every rank so each applies the final norm and head and samples the same
token.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from common.distributed_plan import GroupSpec, PlanError, layer_ranges


def shard_model(model: nn.Module, spec: GroupSpec, group) -> str:
    """Cut `model` to this rank's share in place; returns what the rank holds, for the log."""
    if spec.tp > 1:
        if not hasattr(model, "shard"):
            raise PlanError(f"mlx-lm's {type(model).__module__} has no tensor-parallel shard()")
        model.shard(group)
        return f"1/{spec.tp} of every layer's heads"
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if not isinstance(layers, list) or not layers:
        raise PlanError("--pp-size: the model has no list of layers to split")
    if hasattr(body, "pipeline"):
        body.pipeline(group)
        first, last = body.start_idx, body.end_idx - 1
        return f"layers {first}-{last} of {len(layers)} (mlx-lm's pipeline)"
    ranges = layer_ranges(len(layers), spec.pp)
    mine = ranges[spec.rank]
    kept = layers[mine.start : mine.stop]
    _as_stage(kept, spec.rank, spec.pp, group)
    body.layers = kept
    return f"layers {mine.start}-{mine.stop - 1} of {len(layers)}"


def _as_stage(layers: list, rank: int, size: int, group) -> None:
    """The first layer receives from rank - 1 (not on rank 0), the last sends to rank + 1
    (not on the last rank) and returns the last stage's hidden states, gathered. The
    layers stay themselves (a subclass per layer), so the attributes mlx-lm's
    make_cache reads (`use_sliding`, ...) are still there."""
    _wrap(layers[0], receive_from=rank - 1 if rank > 0 else None, group=group)
    _wrap(layers[-1], send_to=rank + 1 if rank < size - 1 else None, gather=size, group=group)


def _wrap(layer: nn.Module, group, receive_from=None, send_to=None, gather=0) -> None:
    base = type(layer)

    def __call__(self, x, *args, **kwargs):
        if receive_from is not None:
            x = mx.distributed.recv_like(x, receive_from, group=group)
        h = base.__call__(self, x, *args, **kwargs)
        if send_to is not None:
            h = mx.distributed.send(h, send_to, group=group)
        if gather:
            B = h.shape[0]
            h = mx.distributed.all_gather(h, group=group)[(gather - 1) * B :]
        return h

    layer.__class__ = type(f"Stage{base.__name__}", (base,), {"__call__": __call__})
