"""The deploy/ files (and the docs' commands) against the code: service units run
commands the real `radix-mlx` parser accepts, with settings that can work (a replica on
a non-loopback address has keys) and stop timeouts that outlast the drain; every
documented command uses flags its subcommand has; every metric named is exported."""

from __future__ import annotations

import argparse
import plistlib
import re
import shlex
from pathlib import Path

import pytest

from common.server_args import args_from_namespace
from router.cli import build_parser
from router.metrics import METRICS, PREFIX, exported_series
from router.replicas.replica_server import replica_args_problem
from router.serving.launcher import stop_bound
from tests.doc_commands import ROOT, commands_in, flags

DEPLOY = ROOT / "deploy"


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


# ---------------------------------------------------------------- every documented command

DOCUMENTED = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
DOCUMENTED += sorted(
    p for p in DEPLOY.rglob("*") if p.suffix in (".md", ".sh", ".service", ".plist")
)


def _subcommands() -> dict[str, set[str]]:
    """Each subcommand's option strings, from the real parser."""
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return {
        name: {o for action in parser._actions for o in action.option_strings}
        for name, parser in sub.choices.items()
    }


@pytest.mark.parametrize("path", DOCUMENTED, ids=[str(p.relative_to(ROOT)) for p in DOCUMENTED])
def test_documented_commands_use_real_flags(path):
    """Every `radix-mlx SUB --flag` in the docs names a subcommand and flags it takes."""
    known = _subcommands()
    for command in commands_in(path):
        sub, *rest = command
        assert sub in known, (path.name, command)
        unknown = [f for f in flags(rest) if f not in known[sub]]
        assert not unknown, (path.name, sub, unknown)


def test_deploy_files_hold_commands():
    """The extraction finds what it should (an empty check would pass silently)."""
    found = {p.name: len(commands_in(p)) for p in DOCUMENTED}
    assert found["multi-host.md"] == 3 and found["local-replicas.sh"] == 3
    assert found["multi-mac.md"] >= 1 and found["README.md"] >= 5
    assert all(found[p.name] == 1 for p, _ in UNITS)


def _systemd_setting(path: Path, key: str) -> str | None:
    for line in path.read_text().splitlines():
        if line.startswith(key + "="):
            return line.split("=", 1)[1].strip()
    return None


@pytest.mark.parametrize("path, command", UNITS, ids=[p.name for p, _ in UNITS])
def test_service_managers_wait_longer_than_the_drain(path, command):
    """systemd's TimeoutStopSec and launchd's ExitTimeOut (20 s when unset) come before
    their SIGKILL: they must outlast the drain (--graceful-shutdown-timeout) and the
    children's stop, or a drain is cut short."""
    args = args_from_namespace(build_parser().parse_args(command(path)[1:]))
    if path.suffix == ".service":
        assert _systemd_setting(path, "KillSignal") == "SIGTERM"
        wait = float(_systemd_setting(path, "TimeoutStopSec") or 90)
    else:
        wait = plistlib.loads(path.read_bytes()).get("ExitTimeOut", 20)
    assert wait > stop_bound(args), (path.name, wait, stop_bound(args))


def test_documented_metric_names_are_exported():
    """Every radix_mlx_* series the docs, the dashboard or the Prometheus config name is
    one the server exports."""
    exported = exported_series() | {PREFIX + name for name in METRICS}
    for path in [*DOCUMENTED, DEPLOY / "grafana-dashboard.json", DEPLOY / "prometheus.yml"]:
        named = set(re.findall(r"\\bradix_mlx_[a-z_]*[a-z]", path.read_text()))
        assert named <= exported, (path.name, named - exported)
