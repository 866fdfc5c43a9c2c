"""BufferCacheBound on real mlx arrays: the cache stays within the bound under allocations
of ever new sizes, and the bound rises to what the biggest step's temporaries need."""

from __future__ import annotations

import mlx.core as mx
import pytest

from worker_mlx.buffer_cache import FACTOR, FLOOR, BufferCacheBound

CEILING = 1 << 30
MIB = 1 << 20


@pytest.fixture
def bound():
    previous = mx.set_cache_limit(CEILING)  # the CPU backend's limit
    mx.clear_cache()
    try:
        yield BufferCacheBound()
    finally:
        mx.set_cache_limit(previous)
        mx.clear_cache()


def _step(nbytes: int) -> None:
    """A step whose temporaries take about `nbytes`, all freed at its end."""
    x = mx.ones((nbytes // 8,), dtype=mx.float32)
    y = x * 2
    mx.eval(y)
    del x, y


def test_the_cache_stays_within_the_floor_for_steps_of_new_sizes(bound):
    assert (bound.ceiling, bound.limit) == (CEILING, FLOOR)
    for i in range(60):  # 60 steps of ~3 MiB, no two the same size: 180 MiB freed
        _step(3 * MIB + i * 64 * 1024)
        bound.after_step()
        assert mx.get_cache_memory() <= FLOOR
    assert bound.limit == FLOOR  # none of them needed more


def test_the_bound_rises_to_the_biggest_step_and_stays(bound):
    _step(100 * MIB)
    bound.after_step()
    assert 0.9 * FACTOR * 100 * MIB <= bound.limit <= CEILING
    grown = bound.limit
    _step(10 * MIB)
    bound.after_step()
    assert bound.limit == grown
    _step(600 * MIB)
    bound.after_step()
    assert bound.limit == CEILING  # never past the backend's limit
