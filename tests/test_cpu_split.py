"""Big decode-step products in two halves on two CPU streams (worker_mlx/backends/cpu_split.py):
bit-identical to the unsplit product, split only where big, only with two threads."""

from __future__ import annotations

import threading
from functools import partial

import mlx.core as mx
import numpy as np
import pytest

from worker_mlx.backends import cpu_split
from worker_mlx.backends.cpu_kernels import host_exp, scaled_dot_product_attention, swiglu
from worker_mlx.backends.cpu_linear import small_rows_matmul


@pytest.fixture
def split(monkeypatch):
    """The second stream installed (as on any machine with two threads), then removed."""
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    undo = cpu_split.install()
    yield
    undo()


def _both(fn, *args):
    """fn(*args) unsplit, then split (the stream installed around the second call only)."""
    whole = fn(*args)
    mx.eval(whole)
    undo = cpu_split.install()
    try:
        halves = fn(*args)
        mx.eval(halves)
    finally:
        undo()
    return whole, halves


def test_the_second_stream_needs_two_threads_and_a_big_product(monkeypatch):
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")  # a rank given one core of the host
    undo = cpu_split.install()
    assert cpu_split.second_stream(1 << 30) is None
    undo()
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    undo = cpu_split.install()
    try:
        stream = cpu_split.second_stream(cpu_split.MIN_BYTES)
        assert stream is not None and stream != mx.default_stream(mx.cpu)
        assert cpu_split.second_stream(cpu_split.MIN_BYTES - 1) is None
        attention = cpu_split.MIN_ATTENTION_BYTES
        assert cpu_split.second_stream(attention, attention) == stream
        assert cpu_split.second_stream(attention - 1, attention) is None
    finally:
        undo()
    assert cpu_split.second_stream(1 << 30) is None  # the undo turns it off


@pytest.mark.parametrize("compiled", [False, True])
def test_halves_are_the_whole_product(split, compiled):
    w = mx.random.normal((64, 3, 8192), key=mx.random.key(1))  # 6 MiB: split
    x = mx.random.normal((8192, 5), key=mx.random.key(2))

    def product(w, x):
        return cpu_split.halves(lambda part: w[part] @ x, w.shape[0], w.nbytes)

    got = (mx.compile(product) if compiled else product)(w, x)
    assert mx.array_equal(got, w @ x).item()


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("compiled", [False, True])
def test_few_row_linear_in_halves_is_bit_identical(rows, compiled, monkeypatch):
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    w = mx.random.normal((3072, 1024), key=mx.random.key(3)) / 32  # 12 MiB, as medium's MLP
    x = mx.random.normal((rows, 1, 1024), key=mx.random.key(4))
    fn = mx.compile(small_rows_matmul) if compiled else small_rows_matmul
    whole, halves = _both(fn, x, w)
    assert halves.shape == (rows, 1, 3072)
    assert mx.array_equal(whole, halves).item()


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
def test_one_query_attention_in_halves_is_bit_identical(masked, compiled, monkeypatch):
    """Eight rows' K/V of 16 MiB: half of the rows on each stream, per-row masks following
    their rows, against the unsplit attention and mlx's own."""
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    k0, k1, k2, k3 = mx.random.split(mx.random.key(5), 4)
    q = mx.random.normal((8, 4, 1, 64), key=k0)
    k = mx.random.normal((8, 2, 2048, 64), key=k1)
    v = mx.random.normal((8, 2, 2048, 64), key=k2)
    assert k.nbytes + v.nbytes >= cpu_split.MIN_ATTENTION_BYTES
    mask = mx.random.uniform(shape=(8, 1, 1, 2048), key=k3) > 0.3 if masked else None
    attend = partial(scaled_dot_product_attention, scale=0.125, mask=mask)
    fn = mx.compile(attend) if compiled else attend
    whole, halves = _both(fn, q, k, v)
    assert mx.array_equal(whole, halves).item()
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    assert mx.allclose(halves, want, rtol=1e-5, atol=1e-5).item()


@pytest.mark.parametrize("columns, split_", [(1024, False), (2048, True)])
def test_one_query_attention_splits_from_its_own_size(split, columns, split_, monkeypatch):
    """A layer's attention over eight rows is split only from MIN_ATTENTION_BYTES of K/V
    (2,048 columns here, 16 MiB), not from the weights' MIN_BYTES (1,024: 8 MiB)."""
    asked = []
    stream_for = cpu_split.second_stream
    monkeypatch.setattr(
        cpu_split, "second_stream", lambda *a: asked.append(stream_for(*a)) or asked[-1]
    )
    q = mx.zeros((8, 4, 1, 64))
    kv = mx.zeros((8, 2, columns, 64))
    mx.eval(scaled_dot_product_attention(q, kv, kv, scale=0.125, mask=None))
    assert len(asked) == 1 and (asked[0] is not None) == split_


def test_host_halves_run_the_second_half_on_a_helper_thread(split, monkeypatch):
    """Both halves, together exactly the rows, one of them off the calling thread; whole
    below the size, for one row, and without the second stream."""

    def record(shape: tuple[int, ...]) -> list[tuple[int, int, int]]:
        rows = np.arange(shape[0])[(slice(None),) + (None,) * (len(shape) - 1)]
        calls = []
        cpu_split.host_halves(
            lambda a: calls.append((int(a[0, 0]), int(a[-1, 0]) + 1, threading.get_ident())),
            np.broadcast_to(rows, shape),
        )
        return sorted(calls)

    me = threading.get_ident()
    big = cpu_split.MIN_HOST_ELEMENTS
    calls = record((5, big // 5 + 1))
    assert [(a, b) for a, b, _ in calls] == [(0, 2), (2, 5)]
    assert calls[0][2] == me and calls[1][2] != me
    assert [(a, b) for a, b, _ in record((big, 1))] == [(0, big // 2), (big // 2, big)]
    assert record((big - 1, 1)) == [(0, big - 1, me)]  # one element short of the size
    assert record((1, big)) == [(0, 1, me)]
    monkeypatch.setattr(cpu_split, "_second", None)
    assert record((5, big)) == [(0, 5, me)]


@pytest.mark.parametrize(
    "scores_shape,mask_kind,with_sinks",
    [
        ((3, 2, 2, 40, 300), "rows", False),  # split along the batch, a mask per row
        ((1, 2, 2, 40, 300), "causal", True),  # one row: along its KV heads; a shared mask
        ((1, 1, 4, 40, 300), "additive", False),  # one KV head: along its query heads
        ((2, 2, 2, 40, 300), None, True),
    ],
)
def test_host_exp_in_halves_is_bit_identical(monkeypatch, scores_shape, mask_kind, with_sinks):
    """A prefill's softmax with half of its rows on the helper thread: the same exps and
    sums, whatever axis the rows split along and however the mask and sinks broadcast."""
    monkeypatch.setattr(cpu_split, "MIN_HOST_ELEMENTS", 0)
    B, Hk, rep, L, S = scores_shape
    k0, k1, k2 = mx.random.split(mx.random.key(3), 3)
    scores = mx.random.normal(scores_shape, key=k0) * 4
    visible = mx.random.uniform(shape=(B, 1, 1, L, S), key=k1) > 0.3
    visible[..., 0] = True
    mask = {
        None: None,
        "rows": visible,
        "causal": mx.arange(S)[None] <= mx.arange(S - L, S)[:, None],
        "additive": mx.where(visible, 0.0, -mx.inf),
    }[mask_kind]
    sinks = mx.random.normal((1, Hk, rep, 1, 1), key=k2) if with_sinks else None
    # host_exp overwrites its scores: each call gets its own copy
    whole, halves = _both(lambda: host_exp(mx.array(np.array(scores)), mask, sinks))
    for a, b in zip(whole, halves):
        assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("shape", [(1, 300, 96), (5, 7, 64)])
def test_swiglu_in_halves_is_bit_identical(monkeypatch, shape):
    monkeypatch.setattr(cpu_split, "MIN_HOST_ELEMENTS", 0)
    k0, k1 = mx.random.split(mx.random.key(5))
    gate, x = mx.random.normal(shape, key=k0) * 3, mx.random.normal(shape, key=k1)
    whole, halves = _both(swiglu, gate, x)
    assert mx.array_equal(whole, halves).item()
