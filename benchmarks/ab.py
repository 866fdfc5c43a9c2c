"""A/B: one benchmark command in this tree and in a baseline commit's, rounds alternating.

    python -m benchmarks.ab --base REF [--rounds N] [--figure REGEX ...] -- COMMAND ...

for example `python -m benchmarks.ab --base main --rounds 6 -- python -m
benchmarks.one_batch --preset small --batch-size 8`. The baseline is a detached git
worktree of REF under /tmp (made once, reused while it is at REF's commit). Both sides
run with this interpreter (a leading `python` in COMMAND is replaced by it) and the same
virtualenv, each in its own tree as the working directory and first on PYTHONPATH, so
each imports its own code. Rounds go base-new, new-base, ... so a drift of the machine
(another job starting) weighs on both sides alike. Each run's figures are read from its
output with the `--figure` regexes (the first group of each: a number); every figure is
printed as it comes, then per figure the median of each side and the median of the
per-round ratios new / base.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# benchmarks.one_batch's decode figure
DEFAULT_FIGURES = [r"Decode\.\s+median latency: [\d.]+ s, median throughput:\s+([\d.]+)"]


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def baseline_tree(ref: str) -> Path:
    """A detached worktree of `ref` under /tmp: reused if it is at that commit."""
    commit = git("rev-parse", "--verify", f"{ref}^{{commit}}")
    tree = Path("/tmp") / f"radix-mlx-ab-{commit[:12]}"
    if tree.exists():
        if git("rev-parse", "HEAD", cwd=tree) == commit:
            return tree
        raise SystemExit(f"{tree} exists at another commit: remove it (git worktree remove)")
    git("worktree", "add", "--detach", str(tree), commit)
    return tree


def run(tree: Path, command: list[str], figures: list[re.Pattern]) -> list[float]:
    """`command` in `tree`, its own code first on the path; the figures it printed."""
    argv = [
        sys.executable if i == 0 and a in ("python", "python3") else a
        for i, a in enumerate(command)
    ]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"{' '.join(command)} failed in {tree} with {done.returncode}")
    out = []
    for pattern in figures:
        found = pattern.findall(done.stdout)
        if not found:
            raise SystemExit(f"no figure {pattern.pattern!r} in the output in {tree}")
        out.append(float(found[-1]))
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", required=True, help="the baseline git ref (commit, branch, tag)")
    p.add_argument("--rounds", type=int, default=6, help="runs of each side")
    p.add_argument("--figure", action="append", help="regex whose first group is a figure")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the benchmark command")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no benchmark command (put it after --)")
    figures = [re.compile(f) for f in (args.figure or DEFAULT_FIGURES)]
    sides = {"base": baseline_tree(args.base), "new": ROOT}
    print(f"base: {args.base} at {sides['base']}; new: {ROOT}; command: {' '.join(command)}")
    got: dict[str, list[list[float]]] = {"base": [], "new": []}
    for i in range(args.rounds):
        for side in ("base", "new") if i % 2 == 0 else ("new", "base"):
            values = run(sides[side], command, figures)
            got[side].append(values)
            print(f"round {i + 1} {side:4}: " + "  ".join(f"{v:.6g}" for v in values), flush=True)
    summary = {}
    for j, pattern in enumerate(figures):
        base = [r[j] for r in got["base"]]
        new = [r[j] for r in got["new"]]
        ratio = statistics.median(n / b for n, b in zip(new, base))
        summary[pattern.pattern] = ratio
        print(
            f"figure {j + 1}: median base {statistics.median(base):.6g}, "
            f"new {statistics.median(new):.6g}, median ratio new/base {ratio:.4f}"
        )
    return summary


if __name__ == "__main__":
    main()
