"""ServerArgs is the one definition of `radix-mlx serve`'s flags: the parser is derived from
its fields, and the README's Configuration table must list the same flags and defaults.

How a README default cell is compared with the parser's default (backticks are ignored):
- a required flag: `(required)`;
- a switch (store_true, default False): `off`;
- default None: one of NONE_DEFAULTS, alone or followed by `:` and a description
  (`backend's: 256 (CPU), 2048 (GPU)`);
- a list: its items joined by spaces (`*`);
- anything else: str() of the default, exactly (`30000`, `0.5`, `lpm`).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from common.server_args import (
    COMMANDS,
    ServerArgs,
    add_command_args,
    args_from_namespace,
    cli_fields,
    flag_name,
)

README = Path(__file__).resolve().parents[1] / "README.md"
SECTION = "## Configuration (`radix-mlx serve`)"
HEADER = "| flag | default | meaning |"
NONE_DEFAULTS = ("auto", "none", "model's", "model path", "port + 1", "backend's")
REQUIRED = object()


def readme_table(text: str) -> dict[str, str]:
    """{flag: default cell} of the Configuration table in README text."""
    if SECTION not in text:
        raise ValueError(f"no {SECTION!r} section")
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    lines = [line.strip() for line in section.splitlines() if line.strip().startswith("|")]
    if not lines or lines[0] != HEADER:
        raise ValueError(f"the table must start with {HEADER!r}")
    rows: dict[str, str] = {}
    for line in lines[2:]:  # after the header and the |---| line
        if re.fullmatch(r"\| \*\*[a-z ]+\*\* \| \| .* \|", line):
            continue  # a section's row (`| **models** | | ... |`): the flags below are its
        m = re.fullmatch(r"\| `(--[a-z0-9-]+)` \| (.*?) \| .* \|", line)
        if m is None:
            raise ValueError(f"not a row of one flag: {line!r}")
        if m[1] in rows:
            raise ValueError(f"{m[1]} listed twice")
        rows[m[1]] = m[2]
    return rows


def parser_defaults(parser: argparse.ArgumentParser) -> dict[str, object]:
    """{long flag: default, or REQUIRED} of every option but --help."""
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        for option in action.option_strings:
            if option.startswith("--"):
                out[option] = REQUIRED if action.required else action.default
    return out


def default_matches(cell: str, default: object) -> bool:
    cell = cell.replace("`", "").strip()
    if default is REQUIRED:
        return cell == "(required)"
    if default is False:
        return cell == "off"
    if default is None:
        return any(cell == w or cell.startswith(w + ":") for w in NONE_DEFAULTS)
    if isinstance(default, list):
        return cell == " ".join(map(str, default))
    return cell == str(default)


def compare(rows: dict[str, str], defaults: dict[str, object]) -> list[str]:
    """What disagrees between a README table and a parser, one line per flag."""
    problems = [f"{f}: in the parser, not in the README" for f in defaults if f not in rows]
    problems += [f"{f}: in the README, not in the parser" for f in rows if f not in defaults]
    for f, cell in rows.items():
        if f in defaults and not default_matches(cell, defaults[f]):
            shown = "(required)" if defaults[f] is REQUIRED else repr(defaults[f])
            problems.append(f"{f}: README default {cell!r}, parser default {shown}")
    return problems


def serve_parser(command: str = "serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_command_args(parser, command)
    return parser


def every_flag() -> dict[str, object]:
    """The flags of `serve` and of `replica` (the README's table lists both)."""
    return {k: v for c in COMMANDS for k, v in parser_defaults(serve_parser(c)).items()}


def test_readme_table_matches_parser():
    rows = readme_table(README.read_text())
    assert compare(rows, every_flag()) == []


def test_compare_catches_a_flag_missing_from_the_readme():
    flags = every_flag() | {"--new-flag": 1}
    problems = compare(readme_table(README.read_text()), flags)
    assert problems == ["--new-flag: in the parser, not in the README"]


SYNTHETIC = f"""
{SECTION}

{HEADER}
|---|---|---|
| `--model-path` | (required) | the model |
| `--port` | 3000 | HTTP port |
| `--transport` | `ipc` | how processes talk |
| `--trace-dir` | off | a directory |
| `--zmq-port` | port + 1 | SDK port |
| `--prefill-step-size` | backend's: 256 (CPU), 2048 (GPU) | rows |
| `--gone` | 1 | removed from the parser |

## Next section

| `--not-in-the-table` | 1 | ignored |
"""


def test_compare_catches_wrong_defaults_and_extra_rows():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--transport", default="ipc")
    parser.add_argument("--trace-dir", default=None)
    parser.add_argument("--zmq-port", type=int, default=None)
    parser.add_argument("--prefill-step-size", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    assert compare(readme_table(SYNTHETIC), parser_defaults(parser)) == [
        "--seed: in the parser, not in the README",
        "--gone: in the README, not in the parser",
        "--port: README default '3000', parser default 30000",
        "--trace-dir: README default 'off', parser default None",
    ]


@pytest.mark.parametrize(
    "cell, default, ok",
    [
        ("(required)", REQUIRED, True),
        ("none", REQUIRED, False),
        ("off", False, True),
        ("auto", False, False),
        ("auto", None, True),
        ("model's", None, True),
        ("backend's: 0.8 (GPU), 0.5 (CPU)", None, True),
        ("0.5", None, False),
        ("ipc", None, False),
        ("`*`", ["*"], True),
        ("none", ["*"], False),
        ("0.5", 0.5, True),
        ("0.50", 0.5, False),
        ("info", "info", True),
        ("off", 0, False),
        ("0", 0, True),
    ],
)
def test_default_matches(cell, default, ok):
    assert default_matches(cell, default) is ok


def test_a_row_of_two_flags_is_an_error():
    two = SYNTHETIC.replace("| `--port` | 3000 |", "| `--host` / `--port` | 127.0.0.1 / 3000 |")
    with pytest.raises(ValueError, match="not a row of one flag"):
        readme_table(two)


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_shows_its_own_flags_only(command, capsys):
    from router.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert {f.name for f in cli_fields()} == {f.name for f in dataclasses.fields(ServerArgs)}
    for f in cli_fields():
        shown = re.search(rf"^\s+{re.escape(flag_name(f))}\b", out, re.M) is not None
        assert shown is (command in f.metadata["commands"]), f"{command} --help: {flag_name(f)}"


def test_parser_defaults_are_the_dataclass_defaults():
    args = args_from_namespace(serve_parser().parse_args(["--model-path", "m"]))
    assert args == ServerArgs(model_path="m")
    assert args.mem_fraction_static is None and args.prefill_step_size is None
    args.validate()


def test_argparse_types_come_from_the_annotations():
    ns = serve_parser().parse_args(
        "--model-path m --port 8080 --mem-fraction-static 0.7 --prefill-step-size 512 "
        "--disable-radix-cache --allowed-origins --schedule-policy fcfs".split()
    )
    args = args_from_namespace(ns)
    assert args.port == 8080 and args.mem_fraction_static == 0.7
    assert args.prefill_step_size == 512 and args.disable_radix_cache is True
    assert args.allowed_origins == [] and args.schedule_policy == "fcfs"
    ns = serve_parser().parse_args(["--model-path", "m", "--allowed-origins", "a", "b"])
    assert ns.allowed_origins == ["a", "b"]
    assert ServerArgs(model_path="m").allowed_origins is not ServerArgs("m").allowed_origins


def test_served_model_names(capsys):
    """Repeatable, the first reported; without one, the model directory's (or Hugging Face
    id's) last part, never a path; --model-alias repeatable too."""
    flags = "--model-path /models/Qwen3-0.6B-4bit/ --served-model-name a --served-model-name b "
    flags += "--model-alias claude-* --model-alias gpt-?"
    args = args_from_namespace(serve_parser().parse_args(flags.split()))
    assert (args.served_model_names, args.model_name) == (["a", "b"], "a")
    assert args.model_alias == ["claude-*", "gpt-?"]
    assert ServerArgs(model_path="mlx-community/Qwen3-0.6B-4bit").model_name == "Qwen3-0.6B-4bit"
    assert ServerArgs(model_path="/models/Qwen3-0.6B-4bit/").served_model_names == [
        "Qwen3-0.6B-4bit"
    ]
    with pytest.raises(ValueError, match="--served-model-name needs a non-empty name"):
        ServerArgs(model_path="m", served_model_name=[""]).validate()
    for flag in ("--served-model-name", "--model-alias", "--strict-max-tokens"):
        with pytest.raises(SystemExit):  # the router's flags: not a replica's
            serve_parser("replica").parse_args(["--model-path", "m", flag, "x"])
        capsys.readouterr()


def test_parser_rejects_a_value_outside_the_choices(capsys):
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--model-path", "m", "--transport", "udp"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"transport": "udp"}, "--transport must be one of ipc, tcp"),
        ({"schedule_policy": "random"}, "--schedule-policy must be one of lpm, fcfs"),
        ({"log_level": "loud"}, "--log-level must be one of debug, info, warning, error"),
        ({"mem_fraction_static": 1.5}, r"--mem-fraction-static must be in \(0, 1\]"),
        ({"prefill_step_size": 0}, "--prefill-step-size must be >= 1"),
        ({"max_total_tokens": 1}, "--max-total-tokens must be >= 2"),
    ],
)
def test_validate_names_the_flag(kw, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(model_path="m", **kw).validate()


def test_validate_accepts_the_backend_defaults():
    ServerArgs(model_path="m", mem_fraction_static=None, prefill_step_size=None).validate()
    ServerArgs(model_path="m", mem_fraction_static=0.8, prefill_step_size=2048).validate()
