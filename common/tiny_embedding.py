"""A tiny model's sentence-transformers files, which make it an embedding model as
Qwen3-Embedding's are: `modules.json` (Transformer, Pooling, Normalize) and the Pooling
module's `1_Pooling/config.json`. The worker reads them (worker_mlx/embed_pass.py)."""

from __future__ import annotations

import json
from pathlib import Path

_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens",
          "lasttoken")  # fmt: skip
_ST_MODES = {"last": "lasttoken", "mean": "mean_tokens"}


def write_sentence_transformers(out: Path, hidden: int, pooling: str = "last",
                                normalize: bool = True) -> None:  # fmt: skip
    """`pooling`: last or mean; `normalize`: a Normalize module after the Pooling one."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
    ]  # fmt: skip
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})  # fmt: skip
    (out / "1_Pooling").mkdir(exist_ok=True)
    config = {f"pooling_mode_{m}": m == _ST_MODES[pooling] for m in _MODES}
    config |= {"word_embedding_dimension": hidden, "include_prompt": True}
    (out / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    (out / "1_Pooling" / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def save_as_body_only(src: Path, out: Path) -> Path:
    """`src` (a model built untied) saved as Qwen3-Embedding's checkpoints are, from
    transformers' AutoModel: the body's weights without the `model.` prefix and no LM
    head, which mlx-lm's own load refuses (the worker loads it: worker_mlx/headless.py)."""
    import shutil

    import mlx.core as mx

    out.mkdir(parents=True, exist_ok=True)
    for f in src.rglob("*"):
        if f.is_file() and f.name != "model.safetensors":
            (out / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, out / f.relative_to(src))
    weights = mx.load(str(src / "model.safetensors"))
    body = {k.removeprefix("model."): v for k, v in weights.items() if not k.startswith("lm_head")}
    mx.save_safetensors(str(out / "model.safetensors"), body, metadata={"format": "mlx"})
    return out
