"""Real end-to-end checks of the offline tiny-model builder (no mocks, no network)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm import load, stream_generate  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from common.tiny_model import (  # noqa: E402
    BUILDER_VERSION,
    PRESETS,
    build_tiny_model,
    default_cache_dir,
    ensure_tiny_model,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILT_FILES = [
    "model.safetensors",
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
]
MULTIBYTE_TEXTS = [
    "Héllo wörld, ça va? Größe, señor, São João",
    "Καλημέρα κόσμε — Привет, мир",
    "你好，世界！学习需要耐心。",
    "こんにちは、東京の桜はきれいです。",
    "emoji 🚀✨ family 👨‍👩‍👧‍👦 flag 🇯🇵 skin 👍🏽",
    "def f(x):\n\treturn {'a': [1, 2.5e-3]}  # ∑ ≈ ∞",
]


def greedy(x: mx.array) -> mx.array:
    return mx.argmax(x, axis=-1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One default build shared by the read-only tests, to keep the file fast."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def loaded(tiny_dir: Path):
    return load(str(tiny_dir))


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def greedy_tokens(model, tokenizer, prompt: str, n: int) -> tuple[list[int], list[float]]:
    """Greedy continuation plus the top-2 logit gap at every step."""
    tokens, gaps = [], []
    ids = mx.array(tokenizer.encode(prompt))
    for token, logprobs in generate_step(ids, model, max_tokens=n, sampler=greedy):
        tokens.append(int(token))
        top2 = np.sort(np.array(logprobs))[-2:]
        gaps.append(float(top2[1] - top2[0]))
    return tokens, gaps


def test_writes_complete_consistent_model_dir(tiny_dir: Path) -> None:
    for name in BUILT_FILES:
        assert (tiny_dir / name).is_file(), name
    config = read_config(tiny_dir)
    tokenizer = json.loads((tiny_dir / "tokenizer.json").read_text())
    n_vocab = len(tokenizer["model"]["vocab"])
    assert config["vocab_size"] == n_vocab
    assert config["model_type"] == "qwen3"
    assert config["torch_dtype"] == "float32"
    assert config.get("bos_token_id") is None
    specials = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    assert set(specials) == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    assert config["eos_token_id"] == specials["<|im_end|>"]
    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == specials["<|im_end|>"]
    weights = mx.load(str(tiny_dir / "model.safetensors"))
    assert all(w.dtype == mx.float32 for w in weights.values())
    assert weights["model.embed_tokens.weight"].shape == (n_vocab, 64)
    assert "lm_head.weight" not in weights  # tied by default


def test_mlx_lm_loads_and_greedy_output_is_varied(loaded) -> None:
    model, tokenizer = loaded
    all_gaps = []
    for prompt in ["The lighthouse keeper", "def fibonacci(n):", "你好，世界", "1, 2, 3,"]:
        tokens, gaps = greedy_tokens(model, tokenizer, prompt, 32)
        all_gaps += gaps
        assert len(tokens) == 32
        assert len(set(tokens)) >= 8, tokens
        assert len(set(tokens[-8:])) > 1, f"stuck repeating a token: {tokens}"
    # Clear argmax margins, so batched and unbatched float rounding rarely flips a token.
    assert np.median(all_gaps) > 0.05
    assert np.percentile(all_gaps, 5) > 1e-3


def test_stream_generate_yields_text(loaded) -> None:
    model, tokenizer = loaded
    responses = list(stream_generate(model, tokenizer, "Hello 世界", max_tokens=8))
    assert 1 <= len(responses) <= 8
    assert responses[-1].generation_tokens == len(responses)


def test_same_seed_is_byte_identical_across_processes(tiny_dir: Path, tmp_path: Path) -> None:
    """The CLI in a fresh process reproduces the in-process default build exactly."""
    out = tmp_path / "cli"
    result = subprocess.run(
        [sys.executable, "-m", "common.tiny_model", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert str(out) in result.stdout
    for name in BUILT_FILES:
        assert (out / name).read_bytes() == (tiny_dir / name).read_bytes(), name


def test_different_seed_changes_weights_only(tiny_dir: Path, tmp_path: Path) -> None:
    other = build_tiny_model(tmp_path / "s1", seed=1)
    assert (other / "model.safetensors").read_bytes() != (
        tiny_dir / "model.safetensors"
    ).read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()
    assert read_config(other) == read_config(tiny_dir)


def test_llama_gqa_untied_loads_and_generates(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "llama", arch="llama", tie_word_embeddings=False, seed=3)
    config = read_config(path)
    assert config["model_type"] == "llama"
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    model, tokenizer = load(str(path))
    k_proj = model.model.layers[0].self_attn.k_proj.weight
    assert k_proj.shape == (config["num_key_value_heads"] * config["head_dim"], 64)
    assert "lm_head.weight" in mx.load(str(path / "model.safetensors"))
    tokens, _ = greedy_tokens(model, tokenizer, "Once there was a robot", 16)
    assert len(set(tokens)) >= 4


def test_tokenizer_round_trips_multibyte_text(tiny_dir: Path, loaded) -> None:
    hf = AutoTokenizer.from_pretrained(str(tiny_dir))
    _, wrapper = loaded
    split_chars = 0
    for text in MULTIBYTE_TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        assert hf.decode(ids) == text
        split_chars += sum("\ufffd" in hf.decode([i]) for i in ids)
        # mlx-lm's streaming detokenizer, as used when streaming to clients.
        detok = wrapper.detokenizer
        detok.reset()
        for i in ids:
            detok.add_token(i)
        detok.finalize()
        assert detok.text == text
    assert split_chars > 0, "corpus should leave some characters split across tokens"
    assert hf.decode(hf.encode("\x00\x7f\ufffd")) == "\x00\x7f\ufffd"


def test_chat_template_renders_chatml(tiny_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(str(tiny_dir))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi ✨"},
    ]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi ✨<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert hf.eos_token == "<|im_end|>"
    assert hf.pad_token == "<|endoftext|>"
    assert hf.bos_token is None
    ids = hf.encode(text, add_special_tokens=False)
    assert ids[0] == hf.convert_tokens_to_ids("<|im_start|>")


def test_ensure_tiny_model_builds_once(tmp_path: Path) -> None:
    first = ensure_tiny_model(tmp_path, preset="small")
    assert first == tmp_path / f"small-qwen3-s0-v{BUILDER_VERSION}"
    assert read_config(first)["hidden_size"] == PRESETS["small"]["hidden"]
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path, preset="small") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


def test_concurrent_ensure_leaves_one_complete_dir(tmp_path: Path) -> None:
    """Two racing processes both succeed and agree; no temp dirs are left behind."""
    code = "from common.tiny_model import ensure_tiny_model; print(ensure_tiny_model())"
    env = {**os.environ, "RADIX_MLX_CACHE": str(tmp_path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert outputs == {str(tmp_path / f"tiny-qwen3-s0-v{BUILDER_VERSION}")}
    assert [p.name for p in tmp_path.iterdir()] == [f"tiny-qwen3-s0-v{BUILDER_VERSION}"]
    load(outputs.pop())


def test_default_cache_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RADIX_MLX_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("RADIX_MLX_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "radix-mlx"


def test_bos_tokenizer_adds_one_bos_as_llama3s_does(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "bos", arch="llama", bos=True)
    hf = AutoTokenizer.from_pretrained(str(path))
    bos = hf.convert_tokens_to_ids("<|begin_of_text|>")
    assert hf.bos_token == "<|begin_of_text|>" and hf.bos_token_id == bos
    assert read_config(path)["bos_token_id"] == bos
    assert json.loads((path / "generation_config.json").read_text())["bos_token_id"] == bos
    post = json.loads((path / "tokenizer.json").read_text())["post_processor"]
    assert post["type"] == "TemplateProcessing"
    plain = hf.encode("Hello world", add_special_tokens=False)
    assert hf.encode("Hello world") == [bos, *plain]
    messages = [{"role": "user", "content": "Hi"}]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|begin_of_text|><|im_start|>user\n")
    ids = hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids[0] == bos and ids.count(bos) == 1
    model, tokenizer = load(str(path))
    tokens, _ = greedy_tokens(model, tokenizer, "Once there was a robot", 16)
    assert len(set(tokens)) >= 4


def test_a_draft_of_a_silenced_model_agrees_with_it(tmp_path):
    """build_draft_model keeps the first layers; with the later ones silenced the draft's
    greedy tokens are the target's, and without they are not all."""
    from common.tiny_model import build_draft_model, build_tiny_model
    from tests.conftest import mlx_greedy

    prompt = [5, 17, 99, 3, 250, 41]
    plain = build_tiny_model(tmp_path / "plain", layers=3, vocab_size=300)
    silent = build_tiny_model(tmp_path / "silent", layers=3, vocab_size=300, silent_from=1)
    for target, agrees in ((silent, True), (plain, False)):
        draft = build_draft_model(target, tmp_path / f"{target.name}-draft", layers=1)
        config = json.loads((draft / "config.json").read_text())
        assert config["num_hidden_layers"] == 1
        same = mlx_greedy(str(draft), prompt, 12) == mlx_greedy(str(target), prompt, 12)
        assert same == agrees
