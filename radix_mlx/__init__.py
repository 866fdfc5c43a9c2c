"""radix-mlx's Python SDK: talk to a running server over its ZMQ front door.

    from radix_mlx import Client
    with Client("tcp://127.0.0.1:30001") as c:
        print(c.generate("Hello", max_new_tokens=8, temperature=0).text)

This package imports nothing from the server's top-level packages (`router`, `common`,
...), so it works whatever the user's directory holds: a script beside its own
`router.py` or `common.py` still gets this SDK. See `radix_mlx.client` for the API.
"""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("radix-mlx")
except metadata.PackageNotFoundError:  # run from a source tree that is not installed
    __version__ = "0+unknown"

_SDK = (
    "Client",
    "AsyncClient",
    "GenerateResult",
    "StreamChunk",
    "RadixMLXError",
    "RequestTimeout",
    "Usage",
)
__all__ = [*_SDK, "__version__"]


def __getattr__(name: str):
    """The SDK's classes, imported on first use: the server imports this package for its
    wire codec and needs no client."""
    if name in _SDK:
        from radix_mlx import client

        return getattr(client, name)
    raise AttributeError(f"module 'radix_mlx' has no attribute {name!r}")
