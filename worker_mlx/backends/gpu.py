"""The GPU backends: Metal (Apple silicon) and CUDA (mlx[cuda12] on Linux).

Neither installs anything: mlx's own kernels are the fast ones on a GPU (`mx.fast.rope`
and `mx.fast.scaled_dot_product_attention` are real kernels there, not the CPU's
element-by-element fallbacks), and the default buffer cache already spans the device.

Prefill step 2048: on a GPU attention does not materialise the score matrix, so bigger
forward passes fill the device better (the value Metal has always used; on CUDA it is
unmeasured). `compile_decode` is False for both: the compiled decode step
(`decode_step`) is device-neutral code, but it has only been measured on the CPU,
where building the graph was 30% of a batch-8 step; turn it on here once it is measured on
the device. The KV pool may take 80% of the budget, the share Metal has always used (on
CUDA, unmeasured).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from worker_mlx.backends import Backend

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
    def memory_budget(self) -> int:
        """Metal's recommended working set (what the GPU may keep resident without paging)
        less what mlx already holds, the weights."""
        info = device_info()
        if "max_recommended_working_set_size" not in info:
            raise RuntimeError(f"mlx reports no Metal working set ({sorted(info)})")
        return int(info["max_recommended_working_set_size"]) - mx.get_active_memory()


@dataclass(frozen=True)
class CudaBackend(Backend):
    def memory_budget(self) -> int:
        """The GPU's free memory as mlx reports it (NVML's device-wide count, so other
        processes' use and our weights are already out); an mlx that reports only the total
        gets the total less what mlx holds."""
        info = device_info()
        if "free_memory" in info:
            return int(info["free_memory"])
        total = info.get("total_memory") or info.get("memory_size")
        if total is None:
            raise RuntimeError(
                f"mlx reports no CUDA memory size ({sorted(info)}); pass --max-total-tokens"
            )
        return int(total) - mx.get_active_memory()


METAL = MetalBackend(
    name="metal", prefill_step=PREFILL_STEP, mem_fraction=MEM_FRACTION, compile_decode=False
)
CUDA = CudaBackend(
    name="cuda", prefill_step=PREFILL_STEP, mem_fraction=MEM_FRACTION, compile_decode=False
)
