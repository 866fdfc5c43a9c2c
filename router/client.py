"""The ZMQ SDK under its older name (`from radix_mlx import Client` now), kept for
existing code: this module is `radix_mlx.client` itself (one module, two names). It lives
in the `radix_mlx` package so that it imports whatever the user's directory holds (their
own `router.py` or `common.py` would shadow the server's top-level packages)."""

import sys

import radix_mlx.client

sys.modules[__name__] = radix_mlx.client
