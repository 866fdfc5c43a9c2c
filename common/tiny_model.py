"""Build tiny random-weight models that load offline with ``mlx_lm.load``.

Tests and benchmarks need a real model directory (weights, config, tokenizer, chat
template) without downloading anything.  The weights are random but scaled so greedy
decoding produces varied tokens with clear argmax margins, and everything is
deterministic for a given seed so builds are reproducible byte for byte.

Usage::

    python -m common.tiny_model OUT [--preset tiny|small|medium] [--arch qwen3|gemma3|...] [...]

The families (``--arch``) and their layer layouts are in ``common/tiny_families.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import _get_classes as mlx_lm_model_classes
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from common.tiny_embedding import write_sentence_transformers
from common.tiny_families import FAMILIES, family_config
from common.tiny_presets import PRESETS
from common.tiny_weights import random_weights

logger = logging.getLogger(__name__)

# Bump whenever the builder's output changes, so cached models are rebuilt.
BUILDER_VERSION = 2

CORPUS_PATH = Path(__file__).with_name("tiny_corpus.txt")

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
BOS = "<|begin_of_text|>"  # only in models built with bos=True, as Llama 3 names it

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
BOS_CHAT_TEMPLATE = "{{- bos_token }}" + CHAT_TEMPLATE  # as Llama 3's template starts

ARCHES = tuple(FAMILIES)


def default_cache_dir() -> Path:
    """Where built models are cached: ``$RADIX_MLX_CACHE`` or ``~/.cache/radix-mlx``."""
    env = os.environ.get("RADIX_MLX_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "radix-mlx"


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(vocab_size: int, corpus_path: Path = CORPUS_PATH, bos: bool = False) -> Any:
    """Train a byte-level BPE so any UTF-8 text round-trips through encode/decode.

    With ``bos`` its post-processor puts ``BOS`` before every encoded text, as Llama 3's
    tokenizer.json does; encoding with ``add_special_tokens=False`` leaves it out.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + [BOS] * bos,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = corpus_path.read_text(encoding="utf-8")
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A",
            pair=f"{BOS} $A {BOS} $B:1",
            special_tokens=[(BOS, tokenizer.token_to_id(BOS))],
        )
    return tokenizer


def _tokenizer_config(max_length: int, bos: bool) -> dict[str, Any]:
    """HF tokenizer settings: ChatML template, ``<|im_end|>`` ends a turn; no BOS unless
    ``bos``, and then the template writes it (the post-processor adds it to plain text)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS if bos else None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": BOS_CHAT_TEMPLATE if bos else CHAT_TEMPLATE,
    }


def write_tokenizer(
    out_dir: Path, vocab_size: int, max_length: int, bos: bool = False
) -> dict[str, int]:
    """Write tokenizer files and return the ids of the special tokens and the vocab size."""
    tokenizer = train_tokenizer(vocab_size, bos=bos)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(max_length, bos))
    _write_json(
        out_dir / "special_tokens_map.json",
        {"eos_token": IM_END, "pad_token": ENDOFTEXT} | ({"bos_token": BOS} if bos else {}),
    )
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS + [BOS] * bos}
    ids["vocab_size"] = tokenizer.get_vocab_size(with_added_tokens=True)
    return ids


# --------------------------------------------------------------------------- model


def _model_config(
    arch: str,
    dims: dict[str, int],
    *,
    vocab_size: int,
    max_position_embeddings: int,
    rope_theta: float,
    tie_word_embeddings: bool,
    eos_token_id: int,
    bos_token_id: int | None,
) -> dict[str, Any]:
    """The HF-style ``config.json`` that mlx-lm's ``ModelArgs.from_dict`` reads."""
    common = {
        "hidden_size": dims["hidden"],
        "num_hidden_layers": dims["layers"],
        "intermediate_size": dims["intermediate"],
        "num_attention_heads": dims["heads"],
        "num_key_value_heads": dims["kv_heads"],
        "head_dim": dims["head_dim"],
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": float(rope_theta),
        "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": False,
        "torch_dtype": "float32",
        "eos_token_id": eos_token_id,
    }
    if bos_token_id is not None:
        common["bos_token_id"] = bos_token_id
    return family_config(arch, common)


def make_model(
    config: dict[str, Any], seed: int, init_scale: float, norm_offset: float = 0.0
) -> Any:
    """Instantiate the mlx-lm model class for ``config`` and fill in seeded weights."""
    model_class, args_class = mlx_lm_model_classes(config)  # the classes mlx_lm.load picks
    mx.random.seed(seed)  # construction draws from mlx's RNG; every value is replaced below
    model = model_class(args_class.from_dict(config))
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    hidden = config.get("text_config", config)["hidden_size"]
    weights = random_weights(shapes, hidden, seed, init_scale, norm_offset)
    model.update(tree_unflatten([(k, mx.array(v)) for k, v in weights.items()]))
    mx.eval(model.parameters())
    return model


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Stable JSON (sorted keys) so repeated builds are byte-identical."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def build_tiny_model(
    out_dir: str | Path,
    *,
    arch: str = "qwen3",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    intermediate: int = 128,
    vocab_size: int = 512,
    max_position_embeddings: int = 32768,
    rope_theta: float = 10000.0,
    tie_word_embeddings: bool = True,
    init_scale: float = 1.0,
    seed: int = 0,
    bos: bool = False,
    loop: bool = False,
    silent_from: int | None = None,
) -> Path:
    """Write a complete model directory (weights, config, tokenizer) to ``out_dir``.

    With ``silent_from`` N the layers from N on have zero output projections (attention
    and MLP): they compute as any layer but add nothing, so ``build_draft_model(out,
    layers=N)`` is a draft whose greedy tokens are exactly the target's (a draft that
    always agrees, for speculative decoding's benchmarks; random weights give no other).

    With ``loop`` the attention layers' output projections are zero: the next token then
    depends on the last one only, so greedy output soon cycles (a model whose outputs
    repeat themselves, for speculative decoding; each step computes what it always does).

    ``vocab_size`` is the BPE training target; ``config.json`` records the tokenizer's
    actual size so embeddings and tokenizer always agree.  ``layers`` is raised to the
    family's ``min_layers`` so its layout has every layer kind.  With ``bos`` the
    tokenizer adds a BOS as Llama 3's does (see ``train_tokenizer``).
    """
    if arch not in ARCHES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHES}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = write_tokenizer(out, vocab_size, max_position_embeddings, bos)
    family = FAMILIES[arch]
    dims = dict(
        hidden=hidden,
        layers=max(layers, family.min_layers),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=intermediate,
    )
    config = _model_config(
        arch,
        dims,
        vocab_size=tok["vocab_size"],
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tok[IM_END],
        bos_token_id=tok.get(BOS),
    )
    model = make_model(config, seed, init_scale, family.norm_offset)
    weights = dict(tree_flatten(model.parameters()))
    if loop:
        weights = {
            k: mx.zeros_like(v) if k.endswith("o_proj.weight") else v for k, v in weights.items()
        }
    if silent_from is not None:
        weights = {k: _silenced(k, v, silent_from) for k, v in weights.items()}
    if config["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)  # classes that always make one (Gemma) then tie
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {"eos_token_id": tok[IM_END], "pad_token_id": tok[ENDOFTEXT]}
        | ({"bos_token_id": tok[BOS]} if bos else {}),
    )
    logger.info("wrote %s tiny model to %s", arch, out)
    return out


def ensure_tiny_model(
    cache_dir: str | Path | None = None,
    preset: str = "tiny",
    arch: str = "qwen3",
    seed: int = 0,
    bos: bool = False,
    loop: bool = False,
    embedding: bool = False,
) -> Path:
    """Return a cached model dir, building it once; safe against concurrent builders.
    With ``embedding`` it is also a sentence-transformers embedding model (last-token
    pooling, normalized: common/tiny_embedding.py).

    The model is built in a private temp dir and renamed into place, so readers only
    ever see complete directories.  If another process wins the race, its copy is kept.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    variant = ("-bos" if bos else "") + ("-loop" if loop else "") + ("-embed" if embedding else "")
    final = cache / f"{preset}-{arch}{variant}-s{seed}-v{BUILDER_VERSION}"
    if final.is_dir():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=cache))
    try:
        build_tiny_model(tmp, arch=arch, seed=seed, bos=bos, loop=loop, **PRESETS[preset])
        if embedding:
            write_sentence_transformers(tmp, PRESETS[preset]["hidden"])
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(tmp)
    return final


def _silenced(name: str, weight: mx.array, first: int) -> mx.array:
    """Zero for a layer output projection of a layer from `first` on."""
    parts = name.split(".")
    silent = name.endswith(("o_proj.weight", "down_proj.weight")) and parts[1] == "layers"
    return mx.zeros_like(weight) if silent and int(parts[2]) >= first else weight


def build_draft_model(target: str | Path, out_dir: str | Path, layers: int = 1) -> Path:
    """A draft model for speculative decoding: `target`'s first `layers` layers with its
    own embeddings, final norm and head, and its tokenizer files. Its next token is an
    approximation of the target's, so its drafts are accepted part of the time."""
    src, out = Path(target), Path(out_dir)
    config = json.loads((src / "config.json").read_text())
    if not 1 <= layers <= config["num_hidden_layers"]:
        raise ValueError(f"a draft of {src} has 1 to {config['num_hidden_layers']} layers")
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    weights = mx.load(str(src / "model.safetensors"))
    kept = {
        k: v
        for k, v in weights.items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
    }
    mx.save_safetensors(str(out / "model.safetensors"), kept, metadata={"format": "mlx"})
    _write_json(out / "config.json", config | {"num_hidden_layers": layers})
    return out


# --------------------------------------------------------------------------- CLI


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m common.tiny_model", description=__doc__.splitlines()[0]
    )
    p.add_argument("out", type=Path, help="output model directory")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--arch", choices=ARCHES, default="qwen3")
    # Architecture dims default to the preset's values; explicit flags override them.
    p.add_argument("--hidden", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--intermediate", type=int)
    p.add_argument("--vocab-size", type=int, default=512, help="BPE target vocab size")
    p.add_argument("--max-position-embeddings", type=int, default=32768)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--init-scale", type=float, default=1.0, help="weight std multiplier")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bos", action="store_true", help="the tokenizer adds a BOS, as Llama 3's does")
    p.add_argument("--loop", action="store_true", help="zero attention outputs: greedy cycles")
    p.add_argument(
        "--embedding", action="store_true", help="also a sentence-transformers embedding model"
    )
    p.add_argument(
        "--silent-from",
        type=int,
        metavar="N",
        help="zero the output projections of layers N.. (a --draft-of with N layers agrees)",
    )
    p.add_argument(
        "--draft-of",
        type=Path,
        metavar="TARGET",
        help="write a draft model of TARGET instead: its first --layers (default 1) layers",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: build one model and print where it went."""
    args = _parse_args(argv)
    if args.draft_of is not None:
        out = build_draft_model(args.draft_of, args.out, args.layers or 1)
        print(f"wrote a {args.layers or 1}-layer draft of {args.draft_of} to {out}")
        return
    dims = dict(PRESETS[args.preset])
    for key in dims:
        if getattr(args, key) is not None:
            dims[key] = getattr(args, key)
    out = build_tiny_model(
        args.out,
        arch=args.arch,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.max_position_embeddings,
        rope_theta=args.rope_theta,
        tie_word_embeddings=args.tie_word_embeddings,
        init_scale=args.init_scale,
        seed=args.seed,
        bos=args.bos,
        loop=args.loop,
        silent_from=args.silent_from,
        **dims,
    )
    if args.embedding:
        write_sentence_transformers(out, dims["hidden"])
    print(f"wrote {args.preset} {args.arch} model to {out}")


if __name__ == "__main__":
    main()
