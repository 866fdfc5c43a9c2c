"""The models a server with several offers and the names each answers to
(router/serving/model_registry.py), and the flags that ask for several models."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from common.server_args import ServerArgs, args_from_namespace
from router.cli import build_parser
from router.request_error import RequestError
from router.serving.model_registry import ModelRegistry


def _serve_args(*argv: str) -> ServerArgs:
    return args_from_namespace(build_parser().parse_args(["serve", *argv]))


@pytest.fixture(scope="module")
def model_dir(tiny_model, tiny_llama, tmp_path_factory) -> Path:
    """A --model-dir: two model directories, and two that are not models."""
    root = tmp_path_factory.mktemp("models")
    shutil.copytree(tiny_model, root / "qwen")
    shutil.copytree(tiny_llama, root / "llama")
    (root / "notes").mkdir()
    (root / "config-only").mkdir()
    (root / "config-only" / "config.json").write_text("{}")
    return root


def test_repeated_model_path_and_the_single_model_form(tiny_model, tiny_llama):
    args = _serve_args("--model-path", tiny_model, "--model-path", tiny_llama)
    assert args.model_path == tiny_model and args.model_paths == [tiny_model, tiny_llama]
    assert args.several_models
    one = _serve_args("--model-path", tiny_model)
    assert one == ServerArgs(model_path=tiny_model) and not one.several_models
    assert _serve_args("--model-path", tiny_model, "--pin-model", "x").several_models


def test_model_dir_offers_each_model_directory_under_its_name(model_dir):
    registry = ModelRegistry.from_args(_serve_args("--model-dir", str(model_dir)))
    assert list(registry.entries) == ["llama", "qwen"]  # sorted; non-models left out
    assert registry.find(None).name == "llama"  # no model named: the first
    assert registry.find("qwen").path == str((model_dir / "qwen").resolve())


def test_aliases_attach_to_the_model_they_name(model_dir, tiny_model):
    args = _serve_args(
        "--model-path", tiny_model, "--model-dir", str(model_dir), "--served-model-name",
        "main", "--served-model-name", "primary", "--model-alias", "claude-*",
        "--model-alias", "gpt-*=llama",
    )  # fmt: skip
    registry = ModelRegistry.from_args(args)
    first = registry.first.name
    assert list(registry.entries) == ["main", "llama", "qwen"]  # the first is listed as named
    assert registry.find("primary").name == first  # --served-model-name: the first model's
    assert registry.find("claude-haiku-4-5").name == first  # a bare pattern: the first's
    assert registry.find("gpt-4o").name == "llama"
    assert registry.find(tiny_model).name == first  # the path as given
    with pytest.raises(RequestError) as err:
        registry.find("mistral")
    assert err.value.status == 404 and "'mistral' does not exist" in err.value.message


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model-alias", "x=nope"], "--model-alias x=nope: no model 'nope'"),
        (["--pin-model", "nope"], "--pin-model nope: no such model"),
    ],
)
def test_bad_aliases_and_pins_name_the_flag(model_dir, argv, message):
    with pytest.raises(ValueError, match=message):
        ModelRegistry.from_args(_serve_args("--model-dir", str(model_dir), *argv))


def test_two_models_of_one_name_are_refused(model_dir, tiny_llama, tmp_path):
    shutil.copytree(tiny_llama, tmp_path / "qwen")  # another model under the name "qwen"
    argv = ["--model-path", str(tmp_path / "qwen"), "--model-dir", str(model_dir)]
    with pytest.raises(ValueError, match="two models named 'qwen'"):
        ModelRegistry.from_args(_serve_args(*argv))
    same = ["--model-path", str(model_dir / "qwen"), "--model-dir", str(model_dir)]
    assert list(ModelRegistry.from_args(_serve_args(*same)).entries) == ["qwen", "llama"]


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "give --model-path"),
        (["--model-dir", "d", "--max-loaded-models", "0"], "--max-loaded-models must be >= 1"),
        (["--model-dir", "d", "--model-idle-timeout", "0"], "--model-idle-timeout must be > 0"),
        (["--model-dir", "d", "--models-memory-budget", "lots"], "--models-memory-budget"),
        (["--model-dir", "d", "--dp-size", "2"], "not with --replica, --dp-size"),
    ],
)
def test_flag_values_that_cannot_work(argv, message):
    with pytest.raises(ValueError, match=message):
        _serve_args(*argv).validate()


def test_each_adapter_goes_to_its_one_base(tiny_model, tiny_adapters, model_cache):
    """`--lora NAME=PATH` goes to the one served model it applies to; `BASE:NAME` names
    it; a request naming `NAME` or `BASE:NAME` gets that model; ambiguity and a base it
    does not fit are refused with one line."""
    from common.tiny_model import ensure_tiny_model

    small = str(ensure_tiny_model(model_cache, preset="small"))
    qwen, other = Path(tiny_model).name, Path(small).name
    a1, a2 = tiny_adapters
    argv = ["--model-path", small, "--model-path", tiny_model, "--lora", f"a1={a1}",
            "--lora", f"{qwen}:a2={a2}"]  # fmt: skip
    registry = ModelRegistry.from_args(_serve_args(*argv))
    globbed = ModelRegistry.from_args(_serve_args(*argv, "--model-alias", f"*={other}"))
    assert globbed.find("anything").name == other  # a glob of every name: adapters go first
    assert globbed.find("a2").name == globbed.find(f"{qwen}:a1").name == qwen
    assert [s.name for s in registry.entries[qwen].loras] == ["a1", "a2"]
    assert not registry.entries[other].loras
    for name in ("a1", "a2", f"{qwen}:a1"):
        assert registry.find(name).name == qwen
    assert registry.entries[qwen].names().adapter("a2") == 2
    with pytest.raises(RequestError, match=f"{other}:a1"):
        registry.find(f"{other}:a1")
    refusals = [
        ([f"{other}:a1={a1}"], "cannot serve this adapter: it adapts"),
        ([f"nobody:a1={a1}"], "no model 'nobody'"),
        ([f"{qwen}={a1}"], "already a model's name"),
    ]
    for flags, message in refusals:
        argv = ["--model-path", small, "--model-path", tiny_model, "--lora", *flags]
        with pytest.raises(ValueError, match=message):
            ModelRegistry.from_args(_serve_args(*argv))
    twice = _serve_args("--model-path", tiny_model, "--model-path", str(Path(model_cache) /
                        "copy"), "--lora", f"a1={a1}")  # fmt: skip
    shutil.copytree(tiny_model, Path(model_cache) / "copy", dirs_exist_ok=True)
    with pytest.raises(ValueError, match=r"applies to the models .*: name its base as BASE:a1"):
        ModelRegistry.from_args(twice)
