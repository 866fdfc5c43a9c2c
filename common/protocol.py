"""The wire codec under its older name, for the server's code: this module is `radix_mlx.protocol`
itself (one module, two names). It lives in the `radix_mlx` package so the SDK imports
whatever the user's directory holds (their own `router.py` or `common.py` would shadow
the server's top-level packages)."""

import sys

import radix_mlx.protocol

sys.modules[__name__] = radix_mlx.protocol
