"""The worker's structure, checked on its source: modes chosen at construction (no
attribute of a runner assigned from outside it)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _sources(*folders: str):
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path, ast.parse(path.read_text(), filename=str(path))


def _names_a_runner(node: ast.expr) -> bool:
    """`runner`, `x.runner`, `self.h.runner`: an expression that names a runner."""
    if isinstance(node, ast.Name):
        return node.id.endswith("runner")
    return isinstance(node, ast.Attribute) and node.attr.endswith("runner")


def test_no_runner_attribute_is_assigned_from_outside():
    """Modes are constructor arguments: code outside model_runner.py never writes
    `runner.<attribute> = ...` (tests and benchmarks included)."""
    found = []
    for path, tree in _sources("worker_mlx", "tests", "benchmarks"):
        if path.name == "model_runner.py":
            continue
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and _names_a_runner(t.value):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{t.attr}")
    assert not found, "runner attributes assigned from outside:\n" + "\n".join(found)
