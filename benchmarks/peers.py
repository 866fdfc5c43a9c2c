"""The MLX peers `benchmarks.serving` measures radix-mlx against, each in a venv of its own.

    python -m benchmarks.peers            # install every peer (once) and print what each is

vllm-mlx and rapid-mlx pin other mlx-lm releases than ours and pull in torch, so each
lives in `.cache/peers/<name>-<version>/`, built once by `ensure_installed` and reused
while its pins stay the same. mlx_lm.server runs from our own venv (`serving.py`).

Their versions, and the releases they are installed with, are pinned here and nowhere
else. torch is pinned to the CPU build that lies on this kind of machine: both peers ask
for torchvision, whose newest release would pull a CUDA torch of several GB.

None of the peers takes what radix-mlx's OpenAI API takes beyond the standard fields
(`LIMITS`); the benchmark sends them text prompts that re-tokenize to the same ids
(benchmarks.workloads) and counts what they stream. Every peer server is started with
OpenBLAS loaded first (`blas_env`), as radix-mlx's worker loads it, so prefill on a Linux
CPU runs on the same BLAS for every backend.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from worker_mlx.backends.blas import OPENBLAS_PATHS, x86_coretype

# What every peer venv is installed with: our mlx (on Linux its CPU build: the bare wheel
# has no libmlx.so there), the peers' mlx-lm, CPU torch and the torchvision built for it.
TORCH = "torch==2.13.0"
MLX = "mlx==0.32.4" if sys.platform == "darwin" else "mlx[cpu]==0.32.4"
PEER_PINS = (MLX, "mlx-lm==0.31.3", TORCH, "torchvision==0.28.0")
PEER_ROOT = Path(__file__).resolve().parents[1] / ".cache" / "peers"  # gitignored


@dataclass(frozen=True)
class Peer:
    """A peer server installed from PyPI: its package, CLI, serve flags and what it lacks."""

    name: str
    version: str
    cli: str  # the console script in its venv
    serve_flags: tuple[str, ...]  # beside the model, host and port
    limits: tuple[str, ...]
    needs_model_field: bool = False  # requests without "model" get a 422

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


PEERS = {
    "vllm-mlx": Peer(
        "vllm-mlx",
        "0.6.0",
        "vllm-mlx",
        # without it vllm-mlx serves one request at a time ("Simple" mode)
        ("--continuous-batching",),
        (
            "text prompts only (a token-id list is a 422)",
            "`model` is a required field",
            "ignore_eos is not a field: dropped, outputs stop at EOS",
            "streams text without token ids",
            "saves its prefix cache under ~/.cache/vllm-mlx at exit and reloads it at start "
            "(no flag turns that off: benchmarks.serving gives each server a HOME of its own)",
        ),
        needs_model_field=True,
    ),
    "rapid-mlx": Peer(
        "rapid-mlx",
        "0.16.10",
        "rapid-mlx",
        # it otherwise saves its prefix cache under ~/.cache and reloads it on the next
        # start, which would carry one load's prompts into the next fresh server
        ("--disable-disk-caches", "--disable-model-downloads"),
        (
            "text prompts only (a token-id list is a 400)",
            "ignore_eos is not a field of /v1/completions: dropped, outputs stop at EOS",
            "streams text without token ids",
        ),
    ),
}
# mlx_lm.server, `--backend mlx-lm` (benchmarks.serving starts it from our own venv)
MLX_LM_LIMITS = (
    "text prompts only",
    "ignore_eos is not a field: dropped, outputs stop at EOS",
    "streams text without token ids",
)
# Every backend that is not radix-mlx, for "radix-mlx ÷ best peer"; text-only, all of them.
PEER_BACKENDS = ("mlx-lm", *PEERS)


class PeerUnavailable(RuntimeError):
    """A peer that could not be installed here; the message says why."""


def venv_dir(peer: Peer, root: Path = PEER_ROOT) -> Path:
    return root / f"{peer.name}-{peer.version}"


def install_commands(peer: Peer, venv: Path) -> list[list[str]]:
    """Create the venv, put CPU torch in first (so nothing later asks for another torch),
    then the peer with every pin held as a constraint."""
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    pins = ["-c", str(venv / "pins.txt")]
    return [
        [sys.executable, "-m", "venv", str(venv)],
        [*pip, "--upgrade", "pip"],
        [*pip, *pins, TORCH],
        [*pip, *pins, peer.requirement, *PEER_PINS],
    ]


def constraints_text() -> str:
    """PEER_PINS as a pip constraints file, which takes no extras (`mlx[cpu]` is `mlx`)."""
    return "".join(re.sub(r"\[.*\]", "", pin) + "\n" for pin in PEER_PINS)


def stamp_text(peer: Peer) -> str:
    """What a finished install records: a change of any pin means a new install."""
    return "\n".join([peer.requirement, *PEER_PINS]) + "\n"


def ensure_installed(peer: Peer, root: Path = PEER_ROOT, quiet: bool = False) -> Path:
    """The peer's venv, installed now unless an install with the same pins is there.
    Raises PeerUnavailable with the failing step's last output."""
    venv = venv_dir(peer, root)
    stamp = venv / ".installed"
    if stamp.is_file() and stamp.read_text() == stamp_text(peer):
        return venv
    venv.mkdir(parents=True, exist_ok=True)
    (venv / "pins.txt").write_text(constraints_text())
    log = venv / "install.log"
    if not quiet:
        print(f"installing {peer.requirement} into {venv} (once; log: {log})", flush=True)
    with log.open("w") as out:
        for cmd in install_commands(peer, venv):
            out.write(f"$ {' '.join(cmd)}\n")
            out.flush()
            code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
            if code != 0:
                tail = log.read_text().splitlines()[-5:]
                raise PeerUnavailable(f"{peer.requirement}: `{cmd[-1]}` failed ({code}): "
                                      + " | ".join(tail))  # fmt: skip
    versions = installed_versions(venv)
    wrong = pin_mismatches(peer, versions)
    if wrong:
        raise PeerUnavailable(f"{peer.requirement}: installed {', '.join(wrong)}")
    stamp.write_text(stamp_text(peer))
    return venv


def installed_versions(venv: Path) -> dict[str, str]:
    """`pip freeze` of the venv, as {normalized name: version}."""
    cmd = [str(venv / "bin" / "python"), "-m", "pip", "freeze", "--all"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return parse_freeze(out)


def parse_freeze(text: str) -> dict[str, str]:
    """`name==version` lines (others, like editable installs, skipped); names normalized
    as PyPI does, so `mlx_lm` and `mlx-lm` are one package."""
    out = {}
    for line in text.splitlines():
        name, sep, version = line.strip().partition("==")
        if sep:
            out[_normalize(name)] = version
    return out


def pin_mismatches(peer: Peer, versions: dict[str, str]) -> list[str]:
    """Pins the venv does not hold, as `name version` (a local label like +cpu ignored)."""
    wrong = []
    for req in (peer.requirement, *PEER_PINS):
        name, _, version = req.partition("==")
        name = _normalize(name.split("[")[0])
        got = versions.get(name, "missing")
        if got.split("+")[0] != version:
            wrong.append(f"{name} {got} (pinned {version})")
    return wrong


def _normalize(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(".", "-")


def serve_command(peer: Peer, venv: Path, model: str, port: int) -> list[str]:
    cli = str(venv / "bin" / peer.cli)
    return [cli, "serve", model, "--host", "127.0.0.1", "--port", str(port), *peer.serve_flags]


def peer_server(peer: Peer, model: str, port: int) -> tuple[list[str], dict[str, str]]:
    """The command and extra environment that start an installed peer on loopback."""
    return serve_command(peer, venv_dir(peer), model, port), blas_env()


def blas_env() -> dict[str, str]:
    """The environment that makes a peer's mlx use OpenBLAS: preloaded before mlx loads its
    own reference BLAS (worker_mlx/backends/blas.py does it with ctypes in-process), with
    the kernel set picked from the CPU's flags as ours is. Empty where there is none."""
    if sys.platform == "darwin":
        return {}
    path = next((p for p in OPENBLAS_PATHS if os.path.exists(p)), None)
    if path is None:
        return {}
    env = {"LD_PRELOAD": path}
    coretype = os.environ.get("OPENBLAS_CORETYPE") or x86_coretype()
    if coretype:
        env["OPENBLAS_CORETYPE"] = coretype
    return env


def with_peers(backends: tuple[str, ...], peers: list[str]) -> list[str]:
    """A suite load's backends with its peer (mlx-lm in the suite's list) replaced by the
    chosen `--peers`."""
    ours = [b for b in backends if b not in PEER_BACKENDS]
    return ours + list(peers) if len(ours) < len(backends) else ours


def install_peers(plan: list) -> tuple[list, dict[str, str]]:
    """Every peer in a benchmarks.serving plan installed (once); a peer that cannot be
    installed leaves the plan with its reason, which the report repeats."""
    missing = {}
    for backend in dict.fromkeys(pr.backend for pr in plan):
        if backend in PEERS:
            try:
                ensure_installed(PEERS[backend])
            except PeerUnavailable as exc:
                missing[backend] = str(exc)
                print(f"{backend}: not measured, it did not install: {exc}", flush=True)
    return [pr for pr in plan if pr.backend not in missing], missing


def describe() -> str:
    """Every peer with its pins and limits (the report's and docs' note)."""
    lines = [f"peer venvs: {', '.join(PEER_PINS)}"]
    for peer in PEERS.values():
        lines.append(f"{peer.requirement}: `{peer.cli} serve MODEL {' '.join(peer.serve_flags)}`")
        lines += [f"  - {limit}" for limit in peer.limits]
    lines.append("mlx_lm.server (our venv's mlx-lm):")
    lines += [f"  - {limit}" for limit in MLX_LM_LIMITS]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    status = 0
    for peer in PEERS.values():
        try:
            print(f"{peer.requirement}: {ensure_installed(peer)}")
        except PeerUnavailable as exc:
            print(f"{peer.name}: NOT INSTALLED: {exc}")
            status = 1
    print(describe())
    return status


if __name__ == "__main__":
    sys.exit(main())
