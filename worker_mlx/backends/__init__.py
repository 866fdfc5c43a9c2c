"""Device backends: what the worker does differently on each device, chosen once.

A backend is a small profile, picked by `select()` from the device mlx computes on
(`mx.default_device()`) and which GPU backend this mlx was built with, never from the OS:
a Mac running on its CPU gets the CPU profile, and a Linux box with mlx's CUDA backend
(`pip install "mlx[cuda12]"`) gets the CUDA one. A profile holds

- `prefill_step`: prompt tokens per forward pass and row, when --prefill-step-size is not
  given;
- `mem_fraction`: the share of the memory left beside the weights and a step's
  temporaries that the auto-sized KV pool may take, when --mem-fraction-static is not given;
- `max_memory()`: what --max-memory means when it is not given: the most this worker
  process may hold on this device, asked before the model loads (worker_mlx/memory.py);
- `wire(model_bytes)`: Metal's wired limit, as mlx-lm's server sets it;
- `compile_decode`: whether the batched decode step is traced by `mx.compile` and replayed.
  That code is device-neutral (`decode_step`); which profiles turn it on is measured;
- `install(model)`: the device's changes to the process and the model (on the CPU a
  bigger buffer cache, the vectorised exp, the RoPE table and the few-row linear
  layers), returning a function that undoes all of them.

Backends: `cpu` (cpu.py), `metal` and `cuda` (gpu.py). The one CPU-specific step that is
not a profile's is the OpenBLAS preload (blas.py): it must happen before mlx is imported,
so before the device can be asked. For the same reason nothing in this package's
`__init__` imports mlx at module level.
"""

from __future__ import annotations

from typing import Any

from worker_mlx.backends.base import Backend, Name

__all__ = ["Backend", "Name", "select"]


def select(
    device: Any = None,
    *,
    metal: bool | None = None,
    cuda: bool | None = None,
    cpu_kernels: bool = True,
) -> Backend:
    """The backend for `device` (default: mlx's default device), given whether mlx has a
    Metal and a CUDA backend (default: ask mlx). Pure given all three, so every case can be
    checked on any machine. `cpu_kernels=False` (--disable-cpu-kernels) keeps mlx's own exp
    and RoPE and an uncompiled decode step on the CPU; it changes nothing on a GPU."""
    import mlx.core as mx

    from worker_mlx.backends import cpu, gpu

    if device is None:
        device = mx.default_device()
    if metal is None:
        metal = _available(mx, "metal")
    if cuda is None:
        cuda = _available(mx, "cuda")
    kind = getattr(device, "type", device)  # a Device or a DeviceType
    if kind == mx.cpu:
        return cpu.profile(kernels=cpu_kernels)
    if metal:
        return gpu.METAL
    if cuda:
        return gpu.CUDA
    raise RuntimeError(f"mlx computes on {device}, but has neither a Metal nor a CUDA backend")


def _available(mx: Any, backend: str) -> bool:
    """`mx.metal.is_available()` / `mx.cuda.is_available()`, False where this mlx lacks it."""
    module = getattr(mx, backend, None)
    is_available = getattr(module, "is_available", None)
    return bool(is_available()) if is_available is not None else False
