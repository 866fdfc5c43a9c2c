"""The GPU backends: Metal (Apple silicon) and CUDA (mlx[cuda12] on Linux).

Neither installs anything: mlx's own kernels are the fast ones on a GPU (`mx.fast.rope`
and `mx.fast.scaled_dot_product_attention` are real kernels there, not the CPU's
element-by-element fallbacks), and the default buffer cache already spans the device.

Prefill step 2048: on a GPU attention does not materialise the score matrix, so bigger
forward passes fill the device better (the value Metal has always used; on CUDA it is
unmeasured). `compile_decode` is False for both: the compiled decode step
(`decode_step`) is device-neutral code, but it has only been measured on the CPU,
where building the graph was 30% of a batch-8 step; turn it on here once it is measured on
the device. The KV pool may take 80% of what the weights and a step's temporaries leave of
--max-memory, the share Metal has always used (on CUDA, unmeasured).

--max-memory defaults, on Metal, to the GPU's recommended working set (what it may keep
resident without paging; past it macOS swaps GPU memory, and wired pages past the limit are
what kernel panics are made of); on CUDA, to the memory free at start. On Metal the worker
also sets the wired limit to the working set, as mlx-lm's server does, so the weights stay
resident.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx

from worker_mlx.backends.base import Backend

logger = logging.getLogger("worker")

PREFILL_STEP = 2048
MEM_FRACTION = 0.8


def device_info() -> dict:
    """mlx's description of the GPU (`mx.device_info`, or `mx.metal.device_info` in older
    mlx), empty if this mlx has neither."""
    if hasattr(mx, "device_info"):
        return dict(mx.device_info(mx.gpu))
    metal_info = getattr(mx.metal, "device_info", None)
    return dict(metal_info()) if metal_info is not None else {}


@dataclass(frozen=True)
class MetalBackend(Backend):
    def max_memory(self) -> int:
        """Metal's recommended working set (what the GPU may keep resident without paging)."""
        return _working_set()

    def wire(self, model_bytes: int) -> None:
        """mlx-lm's `maybe_set_recommended_wired_limit`: wire up to the working set, with
        its warning when the weights alone come close to it. Never fatal: an mlx without
        wired limits (or a macOS before 15) serves unwired."""
        try:
            working_set = _working_set()
            mx.set_wired_limit(working_set)
        except Exception as exc:  # noqa: BLE001 - a missing API or an OS refusal
            logger.warning("could not set Metal's wired limit: %s", exc)
            return
        if model_bytes > 0.9 * working_set:
            logger.warning(
                "the weights (%d MiB) come close to Metal's recommended working set (%d MiB):"
                " expect paging", model_bytes >> 20, working_set >> 20,
            )  # fmt: skip


def _working_set() -> int:
    info = device_info()
    if "max_recommended_working_set_size" not in info:
        raise RuntimeError(f"mlx reports no Metal working set ({sorted(info)}); pass --max-memory")
    return int(info["max_recommended_working_set_size"])


@dataclass(frozen=True)
class CudaBackend(Backend):
    def max_memory(self) -> int:
        """The GPU's free memory as mlx reports it (NVML's device-wide count, so other
        processes' use is already out) plus what mlx holds; an mlx that reports only the
        total gets the total."""
        info = device_info()
        if "free_memory" in info:
            return int(info["free_memory"]) + mx.get_active_memory()
        total = info.get("total_memory") or info.get("memory_size")
        if total is None:
            raise RuntimeError(
                f"mlx reports no CUDA memory size ({sorted(info)}); pass --max-memory"
            )
        return int(total)


METAL = MetalBackend(
    name="metal", prefill_step=PREFILL_STEP, mem_fraction=MEM_FRACTION, compile_decode=False
)
CUDA = CudaBackend(
    name="cuda", prefill_step=PREFILL_STEP, mem_fraction=MEM_FRACTION, compile_decode=False
)
