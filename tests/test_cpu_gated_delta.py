"""The CPU backend's gated-delta decode step against mlx-lm's own update, on random inputs."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.gated_delta import gated_delta_update

from worker_mlx.backends import cpu_gated_delta


def inputs(seed: int, B: int, Hk: int, Hv: int, Dk: int, Dv: int, T: int = 1):
    keys = mx.random.split(mx.random.key(seed), 8)
    q = mx.random.normal((B, T, Hk, Dk), key=keys[0]) * Dk**-0.5
    k = mx.random.normal((B, T, Hk, Dk), key=keys[1]) * Dk**-0.5
    v = mx.random.normal((B, T, Hv, Dv), key=keys[2])
    a = mx.random.normal((B, T, Hv), key=keys[3])
    b = mx.random.normal((B, T, Hv), key=keys[4])
    A_log = mx.random.normal((Hv,), key=keys[5])
    dt_bias = mx.random.uniform(shape=(Hv,), key=keys[6])
    state = mx.random.normal((B, Hv, Dv, Dk), key=keys[7])
    return q, k, v, a, b, A_log, dt_bias, state


def close(got: mx.array, want: mx.array) -> bool:
    return got.shape == want.shape and mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(
    "B,Hk,Hv,Dk,Dv", [(1, 2, 4, 64, 64), (8, 2, 4, 64, 64), (5, 3, 3, 32, 16), (4, 1, 2, 7, 5)]
)
def test_decode_steps_match_mlx_lm(B, Hk, Hv, Dk, Dv, compiled):
    """Ten steps in a row, each row's state carried, some rows masked out on some steps:
    y and the state stay equal to mlx-lm's reference ops within float32 rounding."""
    fast = (
        mx.compile(cpu_gated_delta.gated_delta_update)
        if compiled
        else cpu_gated_delta.gated_delta_update
    )
    q, k, v, a, b, A_log, dt_bias, state = inputs(B, B, Hk, Hv, Dk, Dv, T=10)
    masks = mx.random.uniform(shape=(B, 10), key=mx.random.key(99)) > 0.3
    ours = theirs = state
    for t in range(10):
        step = [x[:, t : t + 1] for x in (q, k, v, a, b)]
        mask = masks[:, t : t + 1] if t % 2 else None
        y, ours = fast(*step, A_log, dt_bias, ours, mask)
        want_y, theirs = gated_delta_update(*step, A_log, dt_bias, theirs, mask)
        assert close(y, want_y), t
        assert close(ours, theirs), t


def test_a_masked_row_keeps_its_state_exactly():
    q, k, v, a, b, A_log, dt_bias, state = inputs(3, 3, 2, 4, 16, 16)
    mask = mx.array([[True], [False], [True]])
    _, new = cpu_gated_delta.gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, mask)
    assert mx.array_equal(new[1], state[1]).item()
    assert not mx.allclose(new[0], state[0]).item()


def test_options_and_other_shapes_give_mlx_lm_results():
    """A lower-bounded gate and beta in [0, 2] take the fast step; a prefill (many tokens)
    and a missing state are mlx-lm's own code."""
    args = inputs(4, 2, 2, 4, 32, 32)
    for options in ({"lower_bound": -5.0}, {"allow_neg_eigval": True}):
        got = cpu_gated_delta.gated_delta_update(*args, **options)
        want = gated_delta_update(*args, **options)
        assert all(close(x, y) for x, y in zip(got, want))
    prefill = inputs(5, 2, 2, 4, 32, 32, T=6)
    got = cpu_gated_delta.gated_delta_update(*prefill)
    want = gated_delta_update(*prefill)
    assert all(mx.array_equal(x, y).item() for x, y in zip(got, want))
    got = cpu_gated_delta.gated_delta_update(*args[:7])
    want = gated_delta_update(*args[:7])
    assert all(mx.array_equal(x, y).item() for x, y in zip(got, want))


def test_the_start_up_check_passes():
    assert cpu_gated_delta.agrees_with_stock()
