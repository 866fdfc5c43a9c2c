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

from benchmarks.kv_disk_restart import (
    add_session_args,
    restart_session,
    run_and_record,
    tiny_model,
)


def run(args: argparse.Namespace) -> dict:
    blocks = args.prompt_len // args.block

    def bytes_held(kv_dir: Path, log: Path) -> dict:
        """The saved session's bytes against every layer's KV of its blocks."""
        files = list(kv_dir.glob("*/blocks/*/*.safetensors"))
        held = sum(f.stat().st_size for f in files)
        token_bytes = int(re.search(r"KV pool: \d+ tokens x (\d+) bytes", log.read_text())[1])
        every_layer = blocks * args.block * token_bytes
        return {
            "files": len(files), "blocks": blocks, "disk_bytes": held,
            "every_layer_bytes": every_layer, "bytes_ratio": held / every_layer,
        }  # fmt: skip

    r = restart_session(args, tiny_model(args, arch=args.arch), "kv-windows", bytes_held)
    return {**r, "ttft_ratio": r["ratio"]}


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
    add_session_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run_and_record("kv_disk_windows", parse_args(argv), run, report)


if __name__ == "__main__":
    sys.exit(main())
