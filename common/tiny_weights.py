"""Seeded random weights for the tiny models, scaled so greedy decoding is varied and stable.

Init constants, tuned so random models decode greedily into varied, stable tokens:
small embeddings keep a token from predicting itself through the residual stream
(tied weights otherwise create absorbing "t t t t" loops), sharp attention makes the
next token depend on the whole context, and a final-norm gain restores the logit
spread so top-2 margins stay far above float rounding noise.

Parameters that are not matrices or norm gains (attention sinks, recurrent decay rates,
expert-bias corrections) get the values their families' own papers initialise with, so
the recurrent layers keep a long memory and the sinks really take part in the softmax.
"""

from __future__ import annotations

import numpy as np

EMBED_STD = 0.02
QK_GAIN = 2.0  # q and k each scaled by this: attention scores have std ~QK_GAIN**2
LOGIT_STD = 3.0
SINK_MEAN = 2.0  # logit of gpt-oss's sink; large enough that ignoring it changes tokens

_EMBEDDINGS = ("embed_tokens.weight", "embeddings.weight", "lm_head.weight")
_QK = ("q_proj.weight", "k_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight")
_FINAL_NORMS = ("model.norm.weight", "backbone.norm_f.weight")


def _param_std(name: str, shape: tuple[int, ...], init_scale: float) -> float:
    """Std of a weight array: unit-RMS outputs for projections, small embeddings.

    The fan-in is the last axis (``Linear`` and stacked experts alike) except for a
    depthwise convolution, whose every output sums its kernel taps.
    """
    if name.endswith(_EMBEDDINGS):
        return init_scale * EMBED_STD
    fan_in = int(np.prod(shape[1:])) if name.endswith("conv1d.weight") else shape[-1]
    gain = QK_GAIN if name.endswith(_QK) else 1.0
    return init_scale * gain / float(np.sqrt(fan_in))


def _norm_gain(name: str, hidden: int) -> float:
    """Constant RMSNorm weight: sharpens q/k (qwen3) and scales the final logits."""
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return QK_GAIN
    if name.endswith(_FINAL_NORMS):
        return LOGIT_STD / (float(np.sqrt(hidden)) * EMBED_STD)
    return 1.0


def _recurrent_param(leaf: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Mamba's init for the per-head decay: ``A`` in [1, 16], time steps in [1e-3, 1e-1].

    Each step keeps exp(-A * dt) of the state, between 0.2 and almost all of it, so some
    heads remember the whole prompt and a wrong or missing state changes the output.
    """
    if leaf == "A_log":
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), shape))
    return (dt + np.log(-np.expm1(-dt))).astype(np.float32)  # softplus(dt_bias) == dt


def _vector(name: str, shape: tuple[int, ...], hidden: int, norm_offset: float, rng) -> np.ndarray:
    """A one-dimensional parameter: a norm gain unless the name says otherwise."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("A_log", "dt_bias"):
        return _recurrent_param(leaf, shape, rng)
    if leaf == "sinks":
        return (SINK_MEAN + rng.standard_normal(shape)).astype(np.float32)
    if leaf == "D":  # Mamba's skip connection
        return np.ones(shape, dtype=np.float32)
    if leaf.endswith("bias"):  # e.g. DeepSeek's e_score_correction_bias: no expert preferred
        return np.zeros(shape, dtype=np.float32)
    return np.full(shape, _norm_gain(name, hidden) - norm_offset, dtype=np.float32)


def random_weights(
    shapes: dict[str, tuple[int, ...]],
    hidden: int,
    seed: int,
    init_scale: float,
    norm_offset: float = 0.0,
) -> dict[str, np.ndarray]:
    """Seeded init for every parameter; norm weights get constant gains.

    Keys are visited in sorted order so the random stream never depends on dict order.
    ``norm_offset`` is subtracted from norm gains for families whose RMSNorm multiplies
    by ``offset + weight`` (Gemma's ``1 + weight``).
    """
    rng = np.random.Generator(np.random.PCG64(seed))
    weights = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith(".bias"):  # q/k/v, expert and router biases
            weights[name] = np.zeros(shape, dtype=np.float32)
        elif len(shape) == 1:
            weights[name] = _vector(name, shape, hidden, norm_offset, rng)
        else:
            std = np.float32(_param_std(name, shape, init_scale))
            weights[name] = rng.standard_normal(shape, dtype=np.float32) * std
    return weights
