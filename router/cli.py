"""The `radix-mlx` console script."""

from __future__ import annotations

import argparse
import sys

from common.server_args import add_serve_args, args_from_namespace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radix-mlx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser("serve", help="start the router, scheduler and MLX worker")
    add_serve_args(serve_parser)
    ns = parser.parse_args(argv)
    if ns.command == "serve":
        from router.launcher import serve

        return serve(args_from_namespace(ns))
    return 2


if __name__ == "__main__":
    sys.exit(main())
