"""Few-row linear layers as blocks of weight rows (worker_mlx/backends/cpu_linear.py):
the same products as the stock matmul, the same module tree, and greedy decoding of a
batch through the CPU backend token-exact with mlx-lm."""

from __future__ import annotations

import random

import mlx.core as mx
import mlx.nn as nn
import pytest

from tests.conftest import load_model, mlx_greedy, runner_greedy
from worker_mlx.backends import cpu_linear, select
from worker_mlx.backends.cpu_linear import SMALL_MNK, SmallRowsLinear, block_rows


@pytest.mark.parametrize(
    "rows,n,k",
    [(8, 2048, 1024), (8, 1024, 3072), (8, 3072, 1024), (1, 2048, 1024), (4, 1536, 1024)],
)
def test_blocks_are_small_and_tile_the_weight(rows, n, k):
    block = block_rows(rows, n, k)
    assert block is not None and n % block == 0
    assert rows * block * k <= SMALL_MNK < rows * n * k


def test_small_or_many_row_products_keep_the_stock_matmul():
    assert block_rows(8, 256, 256) is None  # already small
    assert block_rows(8, 768, 256) is None  # a weight that stays in the caches
    assert block_rows(512, 2048, 1024) is None  # a prefill


@pytest.mark.parametrize("shape", [(8, 1024), (8, 1, 1024), (2, 3, 1024), (1, 1, 1024)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
def test_matches_the_stock_linear(shape, bias, compiled):
    layer = nn.Linear(1024, 3072, bias=bias)
    x = mx.random.normal(shape, key=mx.random.key(3))
    want = layer(x)
    layer.__class__ = SmallRowsLinear
    got = (mx.compile(layer) if compiled else layer)(x)
    assert got.shape == want.shape
    assert mx.allclose(got, want, rtol=1e-4, atol=1e-4).item()


def test_install_keeps_the_parameters_and_uninstall_restores_the_class(tiny_model):
    model, _ = load_model(tiny_model)
    before = dict(nn.utils.tree_flatten(model.parameters()))
    swapped = cpu_linear.install(model)
    assert swapped and all(type(m) is SmallRowsLinear for m in swapped)
    after = dict(nn.utils.tree_flatten(model.parameters()))
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    cpu_linear.uninstall(swapped)
    assert all(type(m) is nn.Linear for m in swapped)


@pytest.fixture(scope="module")
def medium_model(model_cache) -> str:
    from common.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model(model_cache, preset="medium"))


@pytest.mark.parametrize("preset", ["small", "medium"])
def test_batch_of_eight_through_the_cpu_backend_matches_mlx_lm(preset, model_cache):
    """Eight rows decoding together: every linear layer of the medium preset runs as blocks
    of rows (the small one's keep the stock matmul), compiled, against stock mlx-lm's
    greedy."""
    from common.tiny_model import ensure_tiny_model

    path = str(ensure_tiny_model(model_cache, preset=preset))
    rng = random.Random(13)
    lengths = (3, 20, 45, 70, 99, 130, 160, 200)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]
    steps = 16
    want = [mlx_greedy(path, p, steps) for p in prompts]
    model, _ = load_model(path)
    undo = select().install(model)
    try:
        assert any(type(m) is SmallRowsLinear for _, m in model.named_modules())
        blocked = block_rows(8, *model.model.layers[0].mlp.down_proj.weight.shape)
        assert (blocked is not None) == (preset == "medium")
        got = runner_greedy(model, prompts, steps, 2048)
    finally:
        undo()
    assert got == want
