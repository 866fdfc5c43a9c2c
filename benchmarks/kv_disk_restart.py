"""A restarted server's first request of an old session, from the disk tier, against a
cold prefill of the same length (issue 31's target: TTFT <= 0.2x the cold one).

    python -m benchmarks.kv_disk_restart --preset small --prompt-len 8192

Server 1 (`--kv-disk-dir` in a fresh directory) runs a session's turn: a prompt of
`--prompt-len` random tokens and one output token; once its blocks are on disk it is
stopped. Server 2, on the same directory, gets the session's next turn (that turn plus
`--new-tokens` more), then a cold prompt of the same length with other tokens. Each
request asks for one token, so its latency is its time to first token.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from benchmarks.soak import save_record, start_server


def _first_token(url: str, prompt: list[int]) -> tuple[float, int, list[int]]:
    """(seconds, cached tokens, token ids) of a one-token greedy completion."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    started = time.monotonic()
    res = httpx.post(url + "/v1/completions", json=body, timeout=3600).json()
    took = time.monotonic() - started
    cached = res["usage"]["prompt_tokens_details"]["cached_tokens"]
    return took, cached, res["choices"][0]["token_ids"]


def _wait_blocks(kv_dir: Path, n: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while len(list(kv_dir.glob("*/blocks/*/*.safetensors"))) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {n} blocks written under {kv_dir}")
        time.sleep(0.2)


def _ranks(server_args: str) -> int:
    """Rank processes of the worker: each writes its own part file of every block."""
    words, n = server_args.split(), 1
    for flag in ("--tp-size", "--pp-size"):
        if flag in words:
            n *= int(words[words.index(flag) + 1])
    return n


def restart_session(
    args: argparse.Namespace, model: str, name: str, between: Callable[[Path, Path], dict]
) -> dict:
    """Server 1 runs the session's turn and stops once its blocks are on disk;
    `between(kv_dir, server 1's log)` measures what it left; server 2, on the same
    directory, gets the next turn and a cold prompt of its length. The seconds, cached
    tokens and logs, with what `between` returned."""
    rng = random.Random(args.seed)
    session = [rng.randrange(3, 500) for _ in range(args.prompt_len)]
    kv_dir = Path(tempfile.mkdtemp(prefix=f"{name}-bench-"))
    flags = f"{args.server_args} --kv-disk-dir {kv_dir} --kv-disk-block-tokens {args.block}"
    try:
        server, _, log1, _ = start_server(model, flags, f"{name}-1")
        try:
            cold1, _, out = _first_token(server.url, session)
            _wait_blocks(kv_dir, args.prompt_len // args.block * _ranks(args.server_args))
        finally:
            server.stop()
        measured = between(kv_dir, log1)
        turn = session + out + [rng.randrange(3, 500) for _ in range(args.new_tokens)]
        other = [rng.randrange(3, 500) for _ in range(len(turn))]
        server, _, log2, _ = start_server(model, flags, f"{name}-2")
        try:
            disk, cached, _ = _first_token(server.url, turn)
            cold, _, _ = _first_token(server.url, other)
        finally:
            server.stop()
    finally:
        shutil.rmtree(kv_dir, ignore_errors=True)
    return {
        "first_server_cold_ttft_s": cold1, "restart_ttft_s": disk, "cold_ttft_s": cold,
        "ratio": disk / cold, "cached_tokens": cached, "prompt_tokens": len(turn),
        "logs": [str(log1), str(log2)], **measured,
    }  # fmt: skip


def tiny_model(args: argparse.Namespace, **kind) -> str:
    """--model-path, or the tiny-model builder's --preset (of `kind`, e.g. arch=...)."""
    if args.model_path is not None:
        return args.model_path
    from common.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model(Path.home() / ".cache" / "radix-mlx", preset=args.preset, **kind))


def run(args: argparse.Namespace) -> dict:
    return restart_session(args, tiny_model(args), "kv-disk", lambda kv_dir, log: {})


def report(r: dict) -> str:
    return (
        f"restarted server, next turn of a {r['prompt_tokens']}-token session: TTFT "
        f"{r['restart_ttft_s']:.3f} s with {r['cached_tokens']} tokens from disk; a cold "
        f"prompt of that length: {r['cold_ttft_s']:.3f} s; ratio {r['ratio']:.3f} "
        f"(target <= 0.2)"
    )


def add_session_args(p: argparse.ArgumentParser) -> None:
    """The session's flags (`restart_session`), shared with benchmarks.kv_disk_windows."""
    p.add_argument("--preset", default="small", help="tiny-model preset (without --model-path)")
    p.add_argument("--model-path", default=None)
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--new-tokens", type=int, default=64, help="the next turn's new tokens")
    p.add_argument("--block", type=int, default=256, help="--kv-disk-block-tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="--max-total-tokens 20000")
    p.add_argument("--out", default="bench_results", help="directory for the JSON record")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_disk_restart", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_session_args(p)
    return p.parse_args(argv)


def run_and_record(name: str, args: argparse.Namespace, run, report) -> int:
    """A session benchmark's main: `run(args)`, its `report` printed and saved as a record
    named `name` under `--out`."""
    result = run(args)
    text = report(result)
    print(text)
    save_record(args.out, name, {"args": vars(args), "report": text, **result})
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_and_record("kv_disk_restart", parse_args(argv), run, report)


if __name__ == "__main__":
    sys.exit(main())
