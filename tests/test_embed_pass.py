"""The worker's embedding pass (worker_mlx/embed_pass.py) against mlx-lm's own hidden
states: pooled as the model's config says, normalized, batched equal to one by one, and
rows longer than one pass equal to one whole pass."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from tests.conftest import load_model
from worker_mlx.embed_pass import Embedder, Pooling, read_pooling

ROWS = [[5, 17, 3, 99, 250, 8, 41], [7], [300, 2, 2, 2, 19, 64, 11, 90, 123, 4, 77, 5], [9, 9]]


@pytest.fixture(scope="module")
def embed_model(model_cache) -> str:
    from common.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model(model_cache, preset="tiny", arch="qwen3", embedding=True))


def reference(path: str, ids: list[int], mode: str, normalize: bool = True) -> np.ndarray:
    """mlx-lm's final normed hidden states of `ids` alone, pooled and normalized here."""
    model, _ = load_model(path)
    hidden = np.array(model.model(mx.array([ids])).astype(mx.float32))[0]
    pooled = hidden[-1] if mode == "last" else hidden.mean(axis=0)
    return pooled / np.linalg.norm(pooled) if normalize else pooled


def vectors(embedder: Embedder, rows: list[list[int]]) -> list[np.ndarray]:
    return [np.frombuffer(v, dtype="<f4") for v in embedder.embed(rows)]


@pytest.mark.parametrize("mode", ["last", "mean"])
def test_embeddings_equal_pooled_mlx_lm_hidden_states(embed_model, mode):
    model, tokenizer = load_model(embed_model)
    embedder = Embedder(model, Pooling(mode, True, "test"), 256, len(tokenizer.vocab))
    assert embedder.dim == model.args.hidden_size
    for ids, got in zip(ROWS, vectors(embedder, ROWS)):
        np.testing.assert_allclose(got, reference(embed_model, ids, mode), atol=1e-4)
        assert abs(np.linalg.norm(got) - 1) < 1e-5


@pytest.mark.parametrize("mode", ["last", "mean"])
def test_batched_equals_one_by_one_and_passes_equal_one_pass(embed_model, mode):
    model, tokenizer = load_model(embed_model)
    whole = Embedder(model, Pooling(mode, True, "test"), 256, len(tokenizer.vocab))
    batched = vectors(whole, ROWS)
    for ids, got in zip(ROWS, batched):
        np.testing.assert_allclose(got, vectors(whole, [ids])[0], atol=1e-5)
    # rows over 4 tokens run alone in passes over a throwaway cache: same results
    in_passes = Embedder(model, Pooling(mode, True, "test"), 4, len(tokenizer.vocab))
    for got, want in zip(vectors(in_passes, ROWS), batched):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_unnormalized_pooling_is_the_raw_hidden_state(embed_model):
    model, tokenizer = load_model(embed_model)
    embedder = Embedder(model, Pooling("mean", False, "test"), 256, len(tokenizer.vocab))
    got = vectors(embedder, ROWS[:1])[0]
    np.testing.assert_allclose(got, reference(embed_model, ROWS[0], "mean", False), atol=1e-4)


def test_pooling_is_read_from_sentence_transformers_config(embed_model, tmp_path):
    assert read_pooling(embed_model) == Pooling("last", True, "sentence-transformers modules.json")
    assert read_pooling(embed_model, "mean").mode == "mean"
    assert read_pooling(str(tmp_path)) == Pooling("last", True, "default for a decoder LM")
    # a mean-pooling model without a Normalize module
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False})
    )
    modules = [{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    Path(tmp_path / "modules.json").write_text(json.dumps(modules))
    pooling = read_pooling(str(tmp_path))
    assert (pooling.mode, pooling.normalize) == ("mean", False)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_next", "nemotron_h"])
def test_the_body_is_what_the_head_reads_and_padding_changes_nothing(tiny_arch, arch):
    """Across families (sliding windows, recurrent layers): the body's output is the
    final normed hidden state the LM head reads, and a row batched with longer ones
    (right-padded) embeds as alone."""
    model, tokenizer = load_model(tiny_arch(arch))
    embedder = Embedder(model, Pooling("mean", True, "test"), 256, len(tokenizer.vocab))
    assert embedder.dim == 64
    x = mx.array([ROWS[0]])
    head = getattr(model, "lm_head", None) or embedder.body.embed_tokens.as_linear
    np.testing.assert_allclose(np.array(head(embedder.body(x))), np.array(model(x)), atol=1e-5)
    long = ROWS + [[(7 * i) % 400 + 2 for i in range(40)]]  # past gemma3's 16-token window
    batched = vectors(embedder, long)
    for ids, got in zip(long, batched):
        np.testing.assert_allclose(got, vectors(embedder, [ids])[0], atol=1e-5)
    in_passes = Embedder(model, Pooling("mean", True, "test"), 8, len(tokenizer.vocab))
    np.testing.assert_allclose(vectors(in_passes, long[-1:])[0], batched[-1], atol=1e-5)


def build_body_only(root: Path) -> tuple[str, str]:
    """(a full untied embedding model, the same saved as Qwen3-Embedding-4B/8B's
    checkpoints are: body weights without the `model.` prefix, no LM head)."""
    from common.tiny_embedding import save_as_body_only, write_sentence_transformers
    from common.tiny_model import build_tiny_model
    from common.tiny_presets import PRESETS

    full = build_tiny_model(root / "full", tie_word_embeddings=False, **PRESETS["tiny"])
    write_sentence_transformers(full, PRESETS["tiny"]["hidden"])
    return str(full), str(save_as_body_only(full, root / "body"))


@pytest.fixture(scope="module")
def body_only(tmp_path_factory) -> tuple[str, str]:
    return build_body_only(tmp_path_factory.mktemp("body-only"))


def test_a_body_only_checkpoint_loads_and_embeds_as_the_full_model(body_only):
    from mlx_lm import load

    from worker_mlx.headless import load_headless
    from worker_mlx.loader import _load_servable

    full, body = body_only
    with pytest.raises(ValueError):
        load(body)  # mlx-lm's own load refuses it
    assert load_headless(full) is None  # a complete checkpoint is not one
    model, tokenizer, _config, _layouts = _load_servable(body)
    assert model.headless and model.body_only
    embedder = Embedder(model, read_pooling(body), 256, len(tokenizer.vocab))
    for ids, got in zip(ROWS, vectors(embedder, ROWS)):
        np.testing.assert_allclose(got, reference(full, ids, "last"), atol=1e-4)
