"""Running the agents' own CLIs (Claude Code, Codex), as `make clients` installs them from
tests/clients/package-lock.json, headless against a test's server: a clean environment
(HOME in a temporary directory, no telemetry, update checks or other traffic) and a time
bound on every run."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.doc_commands import ROOT, section_blocks

BIN = ROOT / ".cache" / "clients" / "node_modules" / ".bin"
README_URL = "http://127.0.0.1:30000"  # where the README's settings point
SERVED = ["--served-model-name", "local", "--model-alias", "claude-*"]  # as the README serves
# what keeps Claude Code from calling home (Codex's switches are in its config.toml)
QUIET = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
}


def cli(name: str) -> Path:
    """The installed CLI `name`; skipped where `make clients` could not install it (no
    npm), but a failure in CI, where `make test` installs it."""
    path = BIN / name
    if not path.exists():
        message = f"{path} is missing: run `make clients`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def run_cli(cmd: list, home: Path, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    """`cmd` in `home`/work with only PATH, HOME and `env` set; it must exit 0 in time."""
    work = home / "work"
    work.mkdir(parents=True, exist_ok=True)
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), **QUIET, **env}
    out = subprocess.run(
        [str(c) for c in cmd], cwd=work, env=clean, capture_output=True, text=True,
        timeout=timeout, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert out.returncode == 0, f"{cmd[0]} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    return out


def readme_settings(lang: str, url: str) -> list[str]:
    """The README's "Use it with your agent" blocks in `lang`, pointed at `url`."""
    blocks = section_blocks((ROOT / "README.md").read_text(), "Use it with your agent", lang)
    assert blocks and all(README_URL in b or lang == "bash" for b in blocks), blocks
    return [b.replace(README_URL, url) for b in blocks]


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]
