"""Finding the model directory and loading its tokenizer in the router."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from common.addresses import unavailable_address
from common.distributed_plan import check_model_dir
from common.lora_adapters import check_loras
from common.server_args import ServerArgs


class ModelNotFound(Exception):
    pass


def resolve_model_path(path_or_id: str) -> str:
    """A local directory for `path_or_id`: the path itself, or a Hugging Face snapshot."""
    p = Path(path_or_id).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelNotFound(f"--model-path {path_or_id}: no config.json in that directory")
        return str(p.resolve())
    looks_local = path_or_id.startswith(("/", ".", "~")) or path_or_id.count("/") != 1
    if looks_local or p.exists():
        raise ModelNotFound(f"--model-path {path_or_id}: no such model directory")
    try:
        from huggingface_hub import snapshot_download

        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        return snapshot_download(path_or_id, local_files_only=offline)
    except Exception as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelNotFound(
            f"--model-path {path_or_id}: cannot load from Hugging Face: {first_line}"
        ) from None


class Refused(Exception):
    """Flags a command cannot start with: the one line why, and the exit status (1: a
    value or model that cannot work, 2: an address it cannot listen on)."""

    def __init__(self, line: str, status: int):
        super().__init__(line)
        self.status = status


def resolve_args(args: ServerArgs, command: str | None) -> ServerArgs:
    """What `serve` and `replica` pass their children: `args` validated, with the model
    path resolved to a local directory. Before the model is looked for (it may be
    downloaded), every address `command` listens on must be free (None: this process
    listens on none, a rank of a group under mlx.launch). Refused if not."""
    try:
        args.validate()
    except ValueError as exc:
        raise Refused(str(exc), 1) from None
    problem = unavailable_address(args, command) if command else None
    if problem:
        raise Refused(problem, 2)
    try:
        model_dir = resolve_model_path(args.model_path)
        if args.group_size > 1:  # what cannot be split is refused before a rank starts
            check_model_dir(model_dir, args.tp_size, args.pp_size)
        check_loras(model_dir, args.loras)  # an adapter of another base: refused here
    except (ValueError, ModelNotFound) as exc:
        raise Refused(str(exc), 1) from None
    loras = [f"{s.name}={os.path.abspath(s.path)}" for s in args.loras] or args.lora
    return dataclasses.replace(args, model_path=model_dir, lora=loras)


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
