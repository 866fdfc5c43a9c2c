"""The CPU backend: mlx[cpu] on Linux, or any mlx whose default device is the CPU.

Its numbers were measured on x86 Linux (docs/architecture.md, "the CPU fast path"):

- prefill step 256: attention materialises its score matrix on the CPU, so blocks of a few
  hundred tokens ran ~1.6x faster than 2,048 at once;
- the compiled decode step: building and scheduling a hundred small ops cost more than
  computing them (batch 8 at 300 tokens: 8.9 -> 4.9 ms a step on the small model);
- a 1 GiB buffer cache, the vectorised exp (cpu_kernels) and the RoPE table (cpu_rope).

The KV pool may take half the memory the OS reports available: the rest is for the
prefill's temporaries, the tokenizer and the other processes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from worker_mlx.backends import Backend, cpu_kernels

logger = logging.getLogger("worker")

PREFILL_STEP = 256
MEM_FRACTION = 0.5
# MLX keeps freed buffers for reuse up to this many bytes. Its CPU default here is 32 MiB,
# less than one prefill's attention scores, so every step returned its temporaries to the
# OS and page-faulted them back: a 1 GiB cache made a 2,048-token prefill 1.3-1.6x faster.
# The worker holds the cache below this ceiling, at what its steps need (buffer_cache.py).
BUFFER_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class CpuBackend(Backend):
    # the vectorised exp and the RoPE table (off: --disable-cpu-kernels)
    kernels: bool = True

    def memory_budget(self) -> int:
        """MemAvailable from /proc/meminfo; where there is none (macOS), physical memory
        less what mlx holds (the OS's count of free pages there leaves out its caches)."""
        available = meminfo("MemAvailable")
        if available is not None:
            return available
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return total - mx.get_active_memory()

    def install(self, model: nn.Module) -> Callable[[], None]:
        """Raise (never lower) mlx's buffer cache to BUFFER_CACHE_BYTES and, with `kernels`,
        route the model through cpu_kernels; the undo restores the limit and the model."""
        previous_limit = mx.set_cache_limit(BUFFER_CACHE_BYTES)
        if previous_limit > BUFFER_CACHE_BYTES:
            mx.set_cache_limit(previous_limit)
        uninstall_kernels = cpu_kernels.install(model) if self.kernels else None

        def undo() -> None:
            if uninstall_kernels is not None:
                uninstall_kernels()
            mx.set_cache_limit(previous_limit)

        return undo

    def describe(self) -> str:
        kernels = "CPU kernels" if self.kernels else "mlx's own kernels (--disable-cpu-kernels)"
        return f"{super().describe()}, {kernels}"


def profile(kernels: bool = True) -> CpuBackend:
    """The CPU profile. `kernels=False` is --disable-cpu-kernels: mlx's own exp and RoPE
    and an uncompiled decode step (the buffer cache is raised either way)."""
    return CpuBackend(
        name="cpu",
        prefill_step=PREFILL_STEP,
        mem_fraction=MEM_FRACTION,
        compile_decode=kernels,
        kernels=kernels,
    )


def meminfo(field: str, path: str = "/proc/meminfo") -> int | None:
    """A /proc/meminfo field in bytes, None where there is no such file or field."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
