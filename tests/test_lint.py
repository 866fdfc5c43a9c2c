"""The whole repository passes `ruff check` and `ruff format --check`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).parent / "ruff"


@pytest.mark.parametrize(
    "args", [["check", "."], ["format", "--check", "."]], ids=["check", "format"]
)
def test_ruff(args):
    if not RUFF.exists():
        pytest.skip(f"ruff not installed next to {sys.executable}")
    proc = subprocess.run([str(RUFF), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    output = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0, f"ruff {' '.join(args)} failed:\n{output}"
