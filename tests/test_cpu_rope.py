"""TableRoPE against mx.fast.rope: bit-identical, so greedy tokens cannot change."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from tests.conftest import load_model
from worker_mlx.backends import cpu_kernels, cpu_rope
from worker_mlx.backends.cpu_rope import TableRoPE


def _stock(x, dims, base, scale, offset):
    return mx.fast.rope(x, dims, traditional=False, base=base, scale=scale, offset=offset)


@pytest.mark.parametrize("dims,base,scale", [(64, 10000.0, 1.0), (32, 1e6, 0.25), (64, 500.0, 2.0)])
def test_table_is_bit_identical_to_mlx(dims, base, scale):
    rope = TableRoPE(nn.RoPE(dims, base=base, scale=scale))
    x = mx.random.normal((3, 4, 40, 64), key=mx.random.key(3))
    offsets = [0, 17, 9000, mx.array([0, 300, 4090], dtype=mx.int32)]
    for offset in offsets:
        assert mx.array_equal(rope(x, offset), _stock(x, dims, base, scale, offset)).item()


def test_table_grows_past_its_first_size():
    rope = TableRoPE(nn.RoPE(64))
    x = mx.random.normal((1, 2, 8, 64), key=mx.random.key(4))
    rope(x, 0)
    assert len(rope._table.cos) == cpu_rope.INITIAL_POSITIONS
    far = cpu_rope.INITIAL_POSITIONS * 3 + 5
    got = rope(x, mx.array([far], dtype=mx.int32))
    assert len(rope._table.cos) == cpu_rope.INITIAL_POSITIONS * 4
    assert mx.array_equal(got, _stock(x, 64, 10000.0, 1.0, mx.array([far]))).item()


def test_compiled_and_single_token_calls_take_the_stock_op():
    """Inside mx.compile the table cannot be sized; one-token calls are too small to gain."""
    rope = TableRoPE(nn.RoPE(64))
    x = mx.random.normal((2, 2, 5, 64), key=mx.random.key(5))
    offset = mx.array([3, 9], dtype=mx.int32)
    compiled = mx.compile(lambda x, o: rope(x, o))
    assert mx.array_equal(compiled(x, offset), _stock(x, 64, 10000.0, 1.0, offset)).item()
    assert len(rope._table.cos) == 0
    one = x[:, :, :1]
    assert mx.array_equal(rope(one, 7), _stock(one, 64, 10000.0, 1.0, 7)).item()
    assert len(rope._table.cos) == 0


def test_install_swaps_every_rope_and_uninstall_restores(tiny_llama):
    model, _ = load_model(tiny_llama)
    before = [layer.self_attn.rope for layer in model.model.layers]
    uninstall = cpu_kernels.install(model)
    assert uninstall is not None
    try:
        ropes = [layer.self_attn.rope for layer in model.model.layers]
        assert all(isinstance(r, TableRoPE) for r in ropes)
        assert len({id(r._table) for r in ropes}) == 1  # one table for the model
    finally:
        uninstall()
    assert [layer.self_attn.rope for layer in model.model.layers] == before


def test_traditional_rope_is_left_alone():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.rope = nn.RoPE(16, traditional=True)

    layer = Layer()
    assert cpu_rope.install(layer) == []
    assert type(layer.rope) is nn.RoPE


def test_a_reserved_table_is_looked_up_inside_compile_bit_identically():
    """Reserved for every position (the server's context), the table serves the compiled
    decode step too, one and several tokens a row, with the stock op's exact values."""
    rope = TableRoPE(nn.RoPE(64))
    assert rope._table.reserve(8192) and rope._table.reserved >= 8192
    size = len(rope._table.cos)
    compiled = mx.compile(lambda x, o: rope(x, o))
    for T in (1, 3):
        x = mx.random.normal((3, 2, T, 64), key=mx.random.key(6 + T))
        offset = mx.array([0, 517, 8000], dtype=mx.int32)
        assert mx.array_equal(compiled(x, offset), _stock(x, 64, 10000.0, 1.0, offset)).item()
    assert len(rope._table.cos) == size  # looked up, never resized


def test_a_table_too_big_to_reserve_is_not():
    table = cpu_rope.AngleTable(128, 10000.0, 1.0)
    too_many = cpu_rope.MAX_RESERVED_BYTES // (128 * 4) + 1
    assert not table.reserve(too_many) and table.reserved == 0 and len(table.cos) == 0


def test_install_reserves_the_positions_asked_or_the_models(tiny_llama):
    model, _ = load_model(tiny_llama)
    for positions, want in ((5000, 5000), (None, model.args.max_position_embeddings)):
        uninstall = cpu_kernels.install(model, positions)
        try:
            table = model.model.layers[0].self_attn.rope._table
            assert table.reserved >= want and len(table.cos) == table.reserved
        finally:
            uninstall()
