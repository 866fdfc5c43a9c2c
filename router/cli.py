"""The `radix-mlx` console script."""

from __future__ import annotations

import argparse
import sys

from common.log import quiet_libraries
from common.server_args import add_serve_args, args_from_namespace


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radix-mlx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser("serve", help="start the router, scheduler and MLX worker")
    add_serve_args(serve_parser)
    replica_parser = sub.add_parser(
        "replica", help="start a scheduler and MLX worker that wait for routers on --listen"
    )
    add_serve_args(replica_parser)
    keys_parser = sub.add_parser("keys", help="write CURVE key pairs for routers and replicas")
    keys_parser.add_argument("--out", required=True, help="directory to write the keys to")
    return parser


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()
    ns = build_parser().parse_args(argv)
    if ns.command == "serve":
        from router.launcher import serve

        return serve(args_from_namespace(ns))
    if ns.command == "replica":
        from router.replica_launcher import run_replica

        return run_replica(args_from_namespace(ns))
    if ns.command == "keys":
        return _keys(ns.out)
    return 2


def _keys(out: str) -> int:
    from common.curve import generate_keys

    try:
        files = generate_keys(out)
    except (OSError, FileExistsError) as exc:
        print(f"radix-mlx keys: {exc}", file=sys.stderr)
        return 2
    for path in files:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
