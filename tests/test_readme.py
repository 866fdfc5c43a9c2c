"""The README's commands are ones that work: `radix-mlx` subcommands with their real
flags, `python -m` modules that exist and take the flags written, `make` targets the
Makefile has (and the serve flags given in ARGS), and a curl right after a server
command in one block goes to that server's port."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from tests.doc_commands import (
    ROOT,
    flags,
    inline_spans,
    radix_commands,
    shell_blocks,
    shell_lines,
)
from tests.test_deploy import _subcommands

README = (ROOT / "README.md").read_text()
DEFAULT_PORT = 30000


def _commands() -> list[str]:
    """Every command line of the README: fenced shell lines and inline code spans."""
    fenced = [line for block in shell_blocks(README) for line in shell_lines(block)]
    return fenced + inline_spans(README)


def _python_modules() -> dict[str, set[str]]:
    """`python -m MODULE ...` -> the flags written after it, over the whole README."""
    out: dict[str, set[str]] = {}
    for line in _commands():
        for m in re.finditer(r"python -m ([\w.]+)((?:(?!python -m).)*)", line):
            out.setdefault(m.group(1), set()).update(flags([m.group(2)]))
    return out


def test_radix_mlx_commands_use_real_flags():
    known = _subcommands()
    commands = [c for line in _commands() for c in radix_commands(line)]
    assert len(commands) >= 10
    for sub, *rest in commands:
        if sub.startswith("-"):
            continue  # `radix-mlx --version`: the parser's own
        assert sub in known, sub
        assert set(flags(rest)) <= known[sub], (sub, set(flags(rest)) - known[sub])


def test_make_targets_exist_and_args_are_serve_flags():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    serve = _subcommands()["serve"]
    used = 0
    for line in _commands():
        for m in re.finditer(r"\bmake ([\w-]+)([^`;&|]*)", line):
            used += 1
            assert m.group(1) in targets, m.group(0)
            for word in shlex.split(m.group(2)):
                if word.startswith("ARGS="):
                    assert set(flags([word.removeprefix("ARGS=")])) <= serve, word
    assert used >= 5


def test_a_curl_goes_to_the_port_its_block_started():
    """`make run-local ... PORT=8000` then `curl ...:30000` sent the reader nowhere."""
    checked = 0
    for block in shell_blocks(README):
        port = None
        for line in shell_lines(block):
            started = re.search(r"\bmake run-local\b.*?\bPORT=(\d+)", line) or re.search(
                r"\bradix-mlx serve\b.*?--port[ =](\d+)", line
            )
            if started or re.search(r"\b(make run-local|radix-mlx serve)\b", line):
                port = int(started.group(1)) if started else DEFAULT_PORT
            for url_port in re.findall(r"curl [^|]*?http://(?:127\.0\.0\.1|localhost):(\d+)", line):
                if port is not None:
                    assert int(url_port) == port, (line, port)
                    checked += 1
    assert checked >= 2


@pytest.mark.slow
def test_python_modules_exist_and_take_the_flags_written():
    """Each `python -m MODULE --flag` of the README: the module runs `--help` and lists
    every flag written after it (run all at once: each imports for a second or two)."""
    modules = _python_modules()
    assert len(modules) >= 10
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", name, "--help"],
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        for name in modules
    }
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, (name, out[-2000:])
        listed = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", out))
        assert modules[name] <= listed, (name, modules[name] - listed)
