"""Every tiny-model family builds offline, loads in mlx-lm and has what its name promises.

The serving tests of these families need models whose special parts really matter: a
window that changes the output when widened, sinks that change it when removed, a
recurrent state that changes it when dropped, keys and values of different widths.
Each is checked here against mlx-lm's own model classes and caches.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import ArraysCache, make_prompt_cache  # noqa: E402

from common.tiny_model import ARCHES, build_tiny_model  # noqa: E402

BUILT_FILES = ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"]
PROMPT = "The lighthouse keeper counted the ships that passed in the night, one by one, "
ROUND_TRIP = "Héllo wörld — 你好，世界！ emoji 🚀 def f(x):\n\treturn x"

R, K, A, L = "RotatingKVCache", "KVCache", "ArraysCache", "CacheList"
# mlx-lm's cache per layer (what its make_cache gives): the layouts the builder promises.
CACHE_LAYOUTS = {
    "mistral_swa": [R, R, K],
    "local_swa": [R, R],
    "gemma3": [R, R, K, R],
    "gemma4": [R, R, R, K, R],  # 8 layers: the last 3 reuse layers 2 and 3's K/V
    "gpt_oss": [R, K],
    "deepseek_v3": [K, K],
    "qwen3_moe": [K, K],
    "qwen3_5": [A, A, A, K],
    "qwen3_next": [A, K],
    "granite4": [A, K],
    "falcon_h1": [L, L],  # each a Mamba-2 state and attention KV: the two run side by side
    "nemotron_h": [A, K],  # blocks M - * -: the MLP blocks have no cache
}
SLIDING = [arch for arch, layout in CACHE_LAYOUTS.items() if R in layout]
HYBRID = [arch for arch, layout in CACHE_LAYOUTS.items() if A in layout or L in layout]


def greedy(model, ids: list[int], n: int = 24, cache=None) -> list[int]:
    steps = generate_step(
        mx.array(ids), model, max_tokens=n, sampler=lambda x: mx.argmax(x, -1), prompt_cache=cache
    )
    return [int(token) for token, _ in steps]


def long_prompt(tokenizer, n_tokens: int) -> list[int]:
    ids = tokenizer.encode(PROMPT * (1 + n_tokens // 8))
    assert len(ids) >= n_tokens
    return ids[:n_tokens]


def read_config(path: Path) -> dict:
    config = json.loads((path / "config.json").read_text())
    return config.get("text_config", config)


@pytest.mark.parametrize("arch", ARCHES)
def test_family_is_deterministic_loads_and_decodes_varied(arch, tiny_arch, tmp_path) -> None:
    path = Path(tiny_arch(arch))
    again = build_tiny_model(tmp_path / arch, arch=arch)  # the same seed, from scratch
    for name in BUILT_FILES:
        assert (again / name).read_bytes() == (path / name).read_bytes(), name
    model, tokenizer = load(str(path))
    assert all(w.dtype == mx.float32 for w in mx.load(str(path / "model.safetensors")).values())
    tokens = greedy(model, tokenizer.encode(PROMPT))
    assert len(set(tokens)) >= 8, tokens
    assert len(set(tokens[-8:])) > 1, f"stuck repeating a token: {tokens}"
    # transformers picks some families' own tokenizer classes; text must still round-trip.
    assert tokenizer.decode(tokenizer.encode(ROUND_TRIP)) == ROUND_TRIP


@pytest.mark.parametrize("arch", sorted(CACHE_LAYOUTS))
def test_family_has_its_layer_kinds(arch, tiny_arch) -> None:
    path = Path(tiny_arch(arch))
    model, _ = load(str(path))
    caches = make_prompt_cache(model)
    assert [type(c).__name__ for c in caches] == CACHE_LAYOUTS[arch]
    config = read_config(path)
    for cache in caches:
        if type(cache).__name__ == R:
            assert cache.max_size == config["sliding_window"] < 64


@pytest.mark.parametrize("arch", ARCHES)
def test_small_preset_loads_and_decodes(arch, tiny_arch) -> None:
    model, tokenizer = load(tiny_arch(arch, preset="small"))
    assert len(set(greedy(model, tokenizer.encode(PROMPT), n=16))) >= 6


@pytest.mark.parametrize("arch", SLIDING)
def test_window_changes_the_output(arch, tiny_arch, tmp_path) -> None:
    """The same weights with the window widened past the prompt generate other tokens."""
    path = Path(tiny_arch(arch))
    wide = tmp_path / "wide"
    shutil.copytree(path, wide)
    config = json.loads((wide / "config.json").read_text())
    window = config["sliding_window"]
    config["sliding_window"] = 1 << 20
    (wide / "config.json").write_text(json.dumps(config))
    model, tokenizer = load(str(path))
    ids = long_prompt(tokenizer, 4 * window)
    assert greedy(model, ids) != greedy(load(str(wide))[0], ids)


def test_gpt_oss_sinks_change_the_output(tiny_arch) -> None:
    model, tokenizer = load(tiny_arch("gpt_oss"))
    ids = long_prompt(tokenizer, 48)
    with_sinks = greedy(model, ids)
    for layer in model.layers:
        assert float(mx.abs(layer.self_attn.sinks).min()) > 0
        layer.self_attn.sinks = mx.full(layer.self_attn.sinks.shape, -1e9)  # exp(sink) = 0
    assert greedy(model, ids) != with_sinks


def test_deepseek_v3_caches_keys_and_values_of_different_widths(tiny_arch) -> None:
    path = Path(tiny_arch("deepseek_v3"))
    config = read_config(path)
    model, _ = load(str(path))
    caches = make_prompt_cache(model)
    model(mx.array([[1, 2, 3, 4, 5]]), cache=caches)
    for cache in caches:
        assert cache.keys.shape[-1] == config["kv_lora_rank"]  # the latent
        assert cache.values.shape[-1] == config["qk_rope_head_dim"]  # the RoPE part
    assert config["kv_lora_rank"] != config["qk_rope_head_dim"]


def test_gemma4_shares_kv_and_widens_its_global_layers(tiny_arch) -> None:
    """Gemma 4's KV-shared layers attend an earlier layer's K/V: dropping them from the
    sharing (each gets its own cache) changes nothing but where the K/V come from, so
    instead the shared layers' queries are zeroed to show they matter; the global layer
    caches twice the local head width."""
    path = Path(tiny_arch("gemma4"))
    config = read_config(path)
    model, tokenizer = load(str(path))
    assert len(model.layers) - len(make_prompt_cache(model)) == config["num_kv_shared_layers"]
    caches = make_prompt_cache(model)
    model(mx.array([[1, 2, 3, 4, 5]]), cache=caches)
    widths = [c.keys.shape[-1] for c in caches]
    assert widths == [config["head_dim"]] * 3 + [config["global_head_dim"]] + [config["head_dim"]]
    ids = long_prompt(tokenizer, 40)
    before = greedy(model, ids)
    for layer in model.layers[-config["num_kv_shared_layers"] :]:
        layer.self_attn.q_proj.weight = mx.zeros_like(layer.self_attn.q_proj.weight)
    assert greedy(model, ids) != before


@pytest.mark.parametrize("arch", HYBRID)
def test_recurrent_state_carries_the_prefix(arch, tiny_arch) -> None:
    """A prompt prefilled in two chunks decodes as in one; dropping the state between them
    (the attention layers keep their KV) changes the tokens."""
    model, tokenizer = load(tiny_arch(arch))
    ids = long_prompt(tokenizer, 48)
    whole = greedy(model, ids)

    def after_first_chunk(drop_state: bool) -> list[int]:
        caches = make_prompt_cache(model)
        model(mx.array([ids[:32]]), cache=caches)
        flat = [c for cache in caches for c in getattr(cache, "caches", [cache])]
        for cache in flat:
            if drop_state and isinstance(cache, ArraysCache):
                cache.cache = [None] * len(cache.cache)
        return greedy(model, ids[32:], cache=caches)

    assert after_first_chunk(drop_state=False) == whole
    assert after_first_chunk(drop_state=True) != whole
