"""Load OpenBLAS before mlx on Linux: the mlx[cpu] wheel's reference BLAS is 10-40x slower."""

from __future__ import annotations

import ctypes
import os
import sys

OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)


def preload_openblas() -> str:
    """Make OpenBLAS the process's BLAS if it is installed; returns what BLAS mlx will use.

    Must run before the first `import mlx`; afterwards it can only report.
    """
    if sys.platform == "darwin":
        return "Accelerate"
    if "mlx.core" in sys.modules:
        loaded = _loaded_blas()
        return loaded or "bundled reference BLAS (mlx imported before preload)"
    for path in OPENBLAS_PATHS:
        if os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return f"OpenBLAS ({path})"
    return "bundled reference BLAS (install libopenblas0-pthread for 10-40x faster prefill)"


def _loaded_blas() -> str | None:
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return None
    return "OpenBLAS" if "openblas" in maps else None
