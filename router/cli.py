"""The `radix-mlx` console script."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version

from common.log import quiet_libraries
from common.server_args import add_command_args, args_from_namespace

DESCRIPTION = """\
radix-mlx serves LLMs with Apple MLX (Metal on Apple Silicon, or the CPU on Linux): an
OpenAI- and Anthropic-compatible HTTP API and a ZeroMQ SDK in front of a scheduler whose
radix-tree prefix cache lets a request skip recomputing any prompt prefix seen before,
and an MLX worker that runs the batches. `serve` runs it all on this machine; `replica`
runs a scheduler and worker that `serve --replica` routes to from another machine."""


def package_version() -> str:
    try:
        return version("radix-mlx")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radix-mlx",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"radix-mlx {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser(
        "serve",
        help="start the router (HTTP and SDK), scheduler and MLX worker",
        description="Serve a model on this machine: the router (HTTP API on --port, SDK "
        "front door on --zmq-port), and a scheduler and MLX worker per replica.",
    )
    add_command_args(serve_parser, "serve")
    replica_parser = sub.add_parser(
        "replica",
        help="start a scheduler and MLX worker that wait for routers on --listen",
        description="Run a replica for routers on other machines (`radix-mlx serve "
        "--replica tcp://HOST:PORT`): a scheduler and MLX worker behind --listen.",
    )
    add_command_args(replica_parser, "replica")
    keys_parser = sub.add_parser("keys", help="write CURVE key pairs for routers and replicas")
    keys_parser.add_argument("--out", required=True, help="directory to write the keys to")
    return parser


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()
    ns = build_parser().parse_args(argv)
    if ns.command == "serve":
        args = args_from_namespace(ns)
        if args.several_models:  # loaded on demand
            from router.serving.models_launcher import serve_models

            return serve_models(args)
        from router.serving.launcher import serve

        return serve(args)
    if ns.command == "replica":
        from router.serving.replica_launcher import run_replica

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
