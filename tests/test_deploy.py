"""The service units in deploy/ run commands the real `radix-mlx` parser accepts, with
settings that can work (a replica on a non-loopback address has keys)."""

from __future__ import annotations

import plistlib
import shlex
from pathlib import Path

import pytest

from common.server_args import args_from_namespace
from router.cli import build_parser
from router.replica_server import replica_args_problem

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def _systemd_command(path: Path) -> list[str]:
    text = path.read_text().replace("\\\n", " ")
    line = next(x for x in text.splitlines() if x.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart="))


def _launchd_command(path: Path) -> list[str]:
    return plistlib.loads(path.read_bytes())["ProgramArguments"]


UNITS = [(p, _systemd_command) for p in sorted(DEPLOY.glob("systemd/*.service"))]
UNITS += [(p, _launchd_command) for p in sorted(DEPLOY.glob("launchd/*.plist"))]


@pytest.mark.parametrize("path, command", UNITS, ids=[p.name for p, _ in UNITS])
def test_units_run_commands_the_parser_accepts(path, command):
    argv = command(path)
    assert Path(argv[0]).name == "radix-mlx"
    ns = build_parser().parse_args(argv[1:])
    args = args_from_namespace(ns)
    args.validate()
    if ns.command == "replica":
        assert replica_args_problem(args) is None
    else:
        assert ns.command == "serve" and args.replica and args.curve_secret_key


def test_there_are_units_for_both_roles_on_both_systems():
    names = sorted(p.name for p, _ in UNITS)
    assert names == [
        "com.radix-mlx.replica.plist",
        "com.radix-mlx.router.plist",
        "radix-mlx-replica.service",
        "radix-mlx-router.service",
    ]
