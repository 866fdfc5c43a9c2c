"""What a sliding-window model's saved session costs the disk tier, against what every
layer's KV of its blocks would (the windowed layers' KV is stored only in the window
before a saved prefix's ends), and a restarted server's next turn from disk.

    python -m benchmarks.kv_disk_windows --arch gemma3 --preset small --prompt-len 8192

Server 1 (a fresh `--kv-disk-dir`) runs a session's turn (`--prompt-len` random tokens,
one output token) and stops once its blocks are on disk; the directory's bytes are then
compared with `blocks x block tokens x the pool's bytes per token` (the log's `KV pool:`
line). Server 2 gets the next turn (from disk) and a cold prompt of its length.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from benchmarks.kv_disk_restart import _first_token, _wait_blocks
from benchmarks.soak import save_record, start_server


def run(args: argparse.Namespace) -> dict:
    import random
    import shutil
    import tempfile

    from common.tiny_model import ensure_tiny_model

    model = args.model_path or str(
        ensure_tiny_model(Path.home() / ".cache" / "radix-mlx", preset=args.preset, arch=args.arch)
    )
    rng = random.Random(args.seed)
    session = [rng.randrange(3, 500) for _ in range(args.prompt_len)]
    kv_dir = Path(tempfile.mkdtemp(prefix="kv-windows-bench-"))
    flags = f"{args.server_args} --kv-disk-dir {kv_dir} --kv-disk-block-tokens {args.block}"
    blocks = args.prompt_len // args.block
    try:
        server, _, log1, _ = start_server(model, flags, "kv-windows-1")
        try:
            _, _, out = _first_token(server.url, session)
            _wait_blocks(kv_dir, blocks)
        finally:
            server.stop()
        files = list(kv_dir.glob("*/blocks/*/*.safetensors"))
        held = sum(f.stat().st_size for f in files)
        token_bytes = int(re.search(r"KV pool: \d+ tokens x (\d+) bytes", log1.read_text())[1])
        every_layer = blocks * args.block * token_bytes
        turn = session + out + [rng.randrange(3, 500) for _ in range(args.new_tokens)]
        server, _, log2, _ = start_server(model, flags, "kv-windows-2")
        try:
            disk, cached, _ = _first_token(server.url, turn)
            cold, _, _ = _first_token(server.url, [rng.randrange(3, 500) for _ in turn])
        finally:
            server.stop()
    finally:
        shutil.rmtree(kv_dir, ignore_errors=True)
    return {
        "files": len(files), "blocks": blocks, "disk_bytes": held,
        "every_layer_bytes": every_layer, "bytes_ratio": held / every_layer,
        "restart_ttft_s": disk, "cold_ttft_s": cold, "ttft_ratio": disk / cold,
        "cached_tokens": cached, "prompt_tokens": len(turn), "logs": [str(log1), str(log2)],
    }  # fmt: skip


def report(r: dict) -> str:
    return (
        f"{r['blocks']} blocks saved in {r['files']} files: {r['disk_bytes']} bytes, "
        f"{r['bytes_ratio']:.3f}x every layer's KV of them ({r['every_layer_bytes']}); "
        f"restarted next turn ({r['prompt_tokens']} tokens, {r['cached_tokens']} from disk) "
        f"TTFT {r['restart_ttft_s']:.3f} s, cold {r['cold_ttft_s']:.3f} s, "
        f"ratio {r['ttft_ratio']:.3f}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_disk_windows", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--arch", default="gemma3", help="tiny-model family with sliding windows")
    p.add_argument("--preset", default="small", help="tiny-model preset (without --model-path)")
    p.add_argument("--model-path", default=None)
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--new-tokens", type=int, default=64, help="the next turn's new tokens")
    p.add_argument("--block", type=int, default=256, help="--kv-disk-block-tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="--max-total-tokens 20000")
    p.add_argument("--out", default="bench_results", help="directory for the JSON record")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    text = report(result)
    print(text)
    save_record(args.out, "kv_disk_windows", {"args": vars(args), "report": text, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
