"""Load OpenBLAS before mlx on Linux: the mlx[cpu] wheel's reference BLAS is 10-40x slower.

OpenBLAS picks its kernels from the CPU model it detects; on CPUs newer than the library
(or behind a hypervisor that hides the model) it falls back to Prescott's SSE3 kernels,
4-5x slower again. So unless the user chose one, we pick the kernel set from the CPU's
feature flags, which every hypervisor reports.

This is the one piece of the CPU backend that is not chosen by `backends.select()`: a
library that replaces mlx's BLAS must be loaded before the first `import mlx`, and
`select()` needs mlx to ask for the default device. So the worker calls
`preload_openblas()` first thing, whatever the device. That is harmless on a Linux box
running mlx's CUDA backend: mlx's CPU ops (and its CPU stream) use the same BLAS there.
Importing this module does not import mlx (nor does the `backends` package itself).
"""

from __future__ import annotations

import ctypes
import os
import sys

OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)


def preload_openblas(ranks_on_host: int = 1) -> str:
    """Make OpenBLAS the process's BLAS if it is installed; returns what BLAS mlx will use.
    `ranks_on_host`: the distributed worker's ranks sharing this machine, which split its
    cores between them (unless OPENBLAS_NUM_THREADS says otherwise): two ranks of two
    threads each on two cores wait on each other's preempted threads in every collective
    (a tp-2 batch-8 step on 2 cores: 3.8x one process's, 0.7x with a thread per rank).

    Must run before the first `import mlx`; afterwards it can only report.
    """
    os.environ.update(rank_threads(ranks_on_host))
    if sys.platform == "darwin":  # about the OS, not the device: mlx on macOS links Accelerate
        return "Accelerate"
    if "mlx.core" in sys.modules:
        loaded = _loaded_blas()
        return loaded or "bundled reference BLAS (mlx imported before preload)"
    for path in OPENBLAS_PATHS:
        if os.path.exists(path):
            coretype = os.environ.get("OPENBLAS_CORETYPE") or x86_coretype()
            if coretype:
                os.environ["OPENBLAS_CORETYPE"] = coretype
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            threads = os.environ.get("OPENBLAS_NUM_THREADS")
            each = f", {threads} thread(s)" if threads else ""
            return f"OpenBLAS {_corename(lib) or coretype or ''} ({path}{each})"
    return "bundled reference BLAS (install libopenblas0-pthread for 10-40x faster prefill)"


def rank_threads(ranks_on_host: int) -> dict[str, str]:
    """The environment that gives each of `ranks_on_host` ranks its share of the cores
    (nothing for one rank, or when OPENBLAS_NUM_THREADS is set)."""
    if ranks_on_host <= 1 or "OPENBLAS_NUM_THREADS" in os.environ:
        return {}
    return {"OPENBLAS_NUM_THREADS": str(max(1, cores() // ranks_on_host))}


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _loaded_blas() -> str | None:
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return None
    return "OpenBLAS" if "openblas" in maps else None


def x86_coretype(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The best OpenBLAS x86-64 kernel set these CPU flags support (None: let it detect)."""
    try:
        with open(cpuinfo) as f:
            flags = next(
                (line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []
            )
    except OSError:
        return None
    have = set(flags)
    if {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= have:
        return "Cooperlake"
    if {"avx512f", "avx512bw", "avx512vl"} <= have:
        return "SkylakeX"
    if {"avx2", "fma"} <= have:
        return "Haswell"
    return None


def _corename(lib: ctypes.CDLL) -> str | None:
    try:
        lib.openblas_get_corename.restype = ctypes.c_char_p
        return lib.openblas_get_corename().decode()
    except (AttributeError, UnicodeDecodeError):
        return None
