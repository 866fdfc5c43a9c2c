"""Big decode-step products in two halves on two CPU streams (worker_mlx/backends/cpu_split.py):
bit-identical to the unsplit product, split only where big, only with two threads."""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import pytest

from worker_mlx.backends import cpu_split
from worker_mlx.backends.cpu_kernels import scaled_dot_product_attention
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
    """Eight rows' K/V of 8 MiB: half of the rows on each stream, per-row masks following
    their rows, against the unsplit attention and mlx's own."""
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    k0, k1, k2, k3 = mx.random.split(mx.random.key(5), 4)
    q = mx.random.normal((8, 4, 1, 64), key=k0)
    k = mx.random.normal((8, 2, 1024, 64), key=k1)
    v = mx.random.normal((8, 2, 1024, 64), key=k2)
    assert k.nbytes + v.nbytes >= cpu_split.MIN_BYTES
    mask = mx.random.uniform(shape=(8, 1, 1, 1024), key=k3) > 0.3 if masked else None
    attend = partial(scaled_dot_product_attention, scale=0.125, mask=mask)
    fn = mx.compile(attend) if compiled else attend
    whole, halves = _both(fn, q, k, v)
    assert mx.array_equal(whole, halves).item()
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    assert mx.allclose(halves, want, rtol=1e-5, atol=1e-5).item()
