"""The gated-delta recurrence's decode step for MLX's CPU backend (Qwen3.5 / Qwen3-Next).

mlx-lm's `gated_delta_update` runs a Metal kernel on the GPU and, everywhere else, a
reference step over the (B, H, Dv, Dk) state per token: decay the state, read it with k,
write the delta back, read it again with q. On the CPU every one of those is a pass over
the state, and the two reads are row reductions, which MLX's CPU runs ~5x slower than an
elementwise pass: at batch 8 on the `small` model the step cost 6.5x its batch-1 time.

A decode step (one token per row) here reads the *old* state once, for both vectors:

    kv_mem = g * (S k),  y = S' q = g * (S q) + delta * (k . q),

with S' = g * S + delta k^T, one fused elementwise pass. The reads are two-chunk
multiply-adds over the state's halves (MLX fuses them into one kernel per vector) and a
short row sum. That is mlx-lm's step reassociated, equal within float32 rounding
(`agrees_with_stock`, tests/test_cpu_gated_delta.py). Prefill (many tokens a row), vector
gates and the GPU keep mlx-lm's own code.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx


def stock_update() -> Callable:
    from mlx_lm.models import gated_delta

    return gated_delta.gated_delta_update


def gated_delta_update(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
    *,
    use_kernel: bool = True,
    lower_bound: float | None = None,
    allow_neg_eigval: bool = False,
) -> tuple[mx.array, mx.array]:
    """mlx-lm's `gated_delta_update` (same arguments, same results); one-token rows with
    scalar gates take `decode_step`."""
    stock = stock_update()
    one_token = q.shape[1] == 1 and a.ndim == 3  # (B, 1, Hv): scalar gates
    if not one_token or state is None or mx.default_device() != mx.cpu:
        return stock(q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=use_kernel,
                     lower_bound=lower_bound, allow_neg_eigval=allow_neg_eigval)  # fmt: skip
    from mlx_lm.models.gated_delta import compute_g, compute_lower_bound_g

    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    if lower_bound is None:
        g = compute_g(A_log, a, dt_bias)
    else:
        g = compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
    y, state = decode_step(
        q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, None if mask is None else mask[:, 0]
    )
    return y[:, None], state


def decode_step(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    mask: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """One token per row: q, k (B, Hk, Dk); v (B, Hv, Dv); g, beta (B, Hv); state
    (B, Hv, Dv, Dk); mask (B,) or None (False: the row's state is kept, as mlx-lm's).
    Returns y (B, Hv, Dv) in q's dtype and the new state."""
    if (rep := v.shape[1] // k.shape[1]) > 1:
        q, k = mx.repeat(q, rep, -2), mx.repeat(k, rep, -2)
    s_k, s_q = _reads(state, k, q)
    gate = g[..., None]
    delta = (v - gate * s_k) * beta[..., None]
    y = gate * s_q + delta * (k * q).sum(-1, keepdims=True)
    new_state = state * gate[..., None] + k[..., None, :] * delta[..., None]
    if mask is not None:
        new_state = mx.where(mask[:, None, None, None], new_state, state)
    return y.astype(q.dtype), new_state


def _reads(state: mx.array, *vectors: mx.array) -> list[mx.array]:
    """state @ each vector (B, H, Dk) -> (B, H, Dv): the products of the state's two halves
    added first, an elementwise kernel, so the row sum that follows is half as long."""
    half = state.shape[-1] // 2
    if state.shape[-1] % 2:
        return [(state * x[..., None, :]).sum(-1) for x in vectors]
    lo, hi = state[..., :half], state[..., half:]
    return [(lo * x[..., None, :half] + hi * x[..., None, half:]).sum(-1) for x in vectors]


def agrees_with_stock(atol: float = 1e-5) -> bool:
    """A start-up check against mlx-lm's update on random inputs: grouped heads, a state
    carried over, a mask, and a lower-bounded gate."""
    stock = stock_update()
    B, Hk, Hv, Dk, Dv = 3, 2, 4, 32, 16
    keys = mx.random.split(mx.random.key(1), 7)
    q = mx.random.normal((B, 1, Hk, Dk), key=keys[0]) * Dk**-0.5
    k = mx.random.normal((B, 1, Hk, Dk), key=keys[1]) * Dk**-0.5
    v = mx.random.normal((B, 1, Hv, Dv), key=keys[2])
    a, b = (mx.random.normal((B, 1, Hv), key=key) for key in keys[3:5])
    A_log, dt_bias = mx.random.normal((Hv,), key=keys[5]), mx.ones(Hv)
    state = mx.random.normal((B, Hv, Dv, Dk), key=keys[6])
    mask = mx.array([[True], [False], [True]])
    checks = []
    for m, bound in ((None, None), (mask, None), (None, -5.0)):
        args = (q, k, v, a, b, A_log, dt_bias, state, m)
        checks.append(
            (gated_delta_update(*args, lower_bound=bound), stock(*args, lower_bound=bound))
        )
    return all(
        mx.allclose(x, y, rtol=1e-5, atol=atol).item()
        for got, want in checks
        for x, y in zip(got, want)
    )
