"""The `radix-mlx` commands written in the documentation (README.md, docs/, deploy/): in
fenced shell blocks of Markdown, in shell scripts, in systemd units and launchd plists.
Tests check them against the real parser, so a renamed or removed flag cannot linger in
a recipe a user copies."""

from __future__ import annotations

import plistlib
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
SHELL_FENCES = ("bash", "sh", "shell", "console", "")
SEPARATORS = ("|", ";", "&&", "||", "&", "--", "exec", "sudo", "(")


def shell_blocks(markdown: str) -> list[str]:
    """The contents of a Markdown file's shell code blocks."""
    return [body for lang, body in _FENCE.findall(markdown) if lang in SHELL_FENCES]


def section_blocks(markdown: str, heading: str, lang: str) -> list[str]:
    """The `lang` code blocks of the Markdown section under `## heading`."""
    start = markdown.index(f"\n## {heading}\n")
    end = markdown.find("\n## ", start + 1)
    return [body for kind, body in _FENCE.findall(markdown[start:end]) if kind == lang]


def shell_lines(script: str) -> list[str]:
    """Logical lines (backslash continuations joined), comments dropped."""
    joined = re.sub(r"\\\n", " ", script)
    lines = []
    for line in joined.splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def radix_commands(line: str) -> list[list[str]]:
    """Each `radix-mlx SUBCOMMAND ...` run on a shell line (the first word of a command,
    also after `--` as under mlx.launch; a path ending in radix-mlx counts; a script's
    `$RADIX_MLX` anywhere, as it may be a helper's argument), as its words
    after `radix-mlx` up to a `|`, `;`, `&&` or `&`."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return []
    out, current, starts = [], None, True
    for word in words:
        if word in SEPARATORS:
            current, starts = None, True
        elif current is not None:
            current.append(word)
        elif word == "$RADIX_MLX" or (starts and re.search(r"(^|/)radix-mlx$", word)):
            current = []
            out.append(current)
        else:
            starts = re.fullmatch(r"\w+=\S*", word) is not None  # VAR=value radix-mlx ...
    return [c for c in out if c]


def commands_in(path: Path) -> list[list[str]]:
    """Every radix-mlx command a documentation or deploy file holds."""
    if path.suffix == ".plist":
        argv = plistlib.loads(path.read_bytes())["ProgramArguments"]
        return [argv[1:]]
    text = path.read_text()
    if path.suffix == ".md":
        lines = [line for block in shell_blocks(text) for line in shell_lines(block)]
    elif path.suffix == ".service":
        lines = [
            line.removeprefix("ExecStart=")
            for line in shell_lines(text)
            if line.startswith("ExecStart=")
        ]
    else:
        lines = shell_lines(text)
    return [c for line in lines for c in radix_commands(line)]


def inline_spans(markdown: str) -> list[str]:
    """The inline code spans of a Markdown text (outside its fenced blocks), one line each."""
    prose = _FENCE.sub("", markdown)
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]


def flags(command: list[str]) -> list[str]:
    """The `--flag`s of a command (`--flag=value` and a usage line's `[--flag X]` too)."""
    return re.findall(r"(?<![\w-])--[a-z][\w-]*", " ".join(command))
