"""The CPU backend: mlx[cpu] on Linux, or any mlx whose default device is the CPU.

Its numbers were measured on x86 Linux (docs/architecture.md, "the CPU fast path"):

- prefill step 256: attention materialises its score matrix on the CPU, so blocks of a few
  hundred tokens ran ~1.6x faster than 2,048 at once;
- the compiled decode step: building and scheduling a hundred small ops cost more than
  computing them (batch 8 at 300 tokens: 8.9 -> 4.9 ms a step on the small model);
- a 1 GiB buffer cache, the vectorised exp (cpu_kernels) and the RoPE table (cpu_rope);
- few-row linear layers as blocks of weight rows (cpu_linear): a batch-8 step of the
  medium preset 0.5x as long at short context (docs/performance.md, issue 32);
- a decode step's big products in halves on two CPU streams (cpu_split): that step 0.6x
  as long again, at 1k and 8k tokens of context; a prefill's big numpy softmax and SwiGLU
  in halves on two threads: a batch-8 prefill of 256-token prompts 0.89x as long.

--max-memory defaults to the memory the OS reports available at start (MemAvailable)
less a margin for the router, the scheduler and the page cache: 10%, at least 512 MiB.
The KV pool may take half of what the weights and a step's temporaries leave of it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from worker_mlx.backends import cpu_kernels, cpu_linear, cpu_split
from worker_mlx.backends.base import Backend

logger = logging.getLogger("worker")

PREFILL_STEP = 256
MEM_FRACTION = 0.5
MARGIN, MIN_MARGIN = 0.1, 512 << 20  # kept out of the default --max-memory
# MLX keeps freed buffers for reuse up to this many bytes. Its CPU default here is 32 MiB,
# less than one prefill's attention scores, so every step returned its temporaries to the
# OS and page-faulted them back: a 1 GiB cache made a 2,048-token prefill 1.3-1.6x faster.
# The worker holds the cache below this ceiling, at what its steps need (buffer_cache.py).
BUFFER_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class CpuBackend(Backend):
    # the vectorised exp, the RoPE table and the few-row linear layers (off:
    # --disable-cpu-kernels)
    kernels: bool = True

    def max_memory(self) -> int:
        """MemAvailable from /proc/meminfo plus what mlx already holds, less the margin;
        where there is none (macOS), physical memory less the margin (the OS's count of
        free pages there leaves out its caches)."""
        available = meminfo("MemAvailable")
        if available is None:
            available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        else:
            available += mx.get_active_memory()
        return available - max(int(available * MARGIN), MIN_MARGIN)

    def install(self, model: nn.Module, positions: int | None = None) -> Callable[[], None]:
        """Raise (never lower) mlx's buffer cache to BUFFER_CACHE_BYTES and, with `kernels`,
        route the model through cpu_kernels, cpu_linear and cpu_split; the undo restores
        the limit and the model. `positions`: the most a request's can reach (RoPE
        tables, cpu_rope)."""
        previous_limit = mx.set_cache_limit(BUFFER_CACHE_BYTES)
        if previous_limit > BUFFER_CACHE_BYTES:
            mx.set_cache_limit(previous_limit)
        uninstall_kernels = cpu_kernels.install(model, positions) if self.kernels else None
        small_rows = []
        if self.kernels and cpu_linear.agrees_with_stock():
            small_rows = cpu_linear.install(model)
        unsplit = cpu_split.install() if self.kernels else None

        def undo() -> None:
            if uninstall_kernels is not None:
                uninstall_kernels()
            cpu_linear.uninstall(small_rows)
            if unsplit is not None:
                unsplit()
            mx.set_cache_limit(previous_limit)

        return undo

    def describe(self) -> str:
        kernels = "CPU kernels" if self.kernels else "mlx's own kernels (--disable-cpu-kernels)"
        return f"{super().describe()}, {kernels}"


def profile(kernels: bool = True) -> CpuBackend:
    """The CPU profile. `kernels=False` is --disable-cpu-kernels: mlx's own exp, RoPE and
    linear layers on one stream, and an uncompiled decode step (the buffer cache is raised
    either way)."""
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
