"""Device backends: chosen from the device, not the OS; the CPU one installs and undoes."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest

from tests.conftest import load_model
from worker_mlx.backends import cpu, cpu_kernels, gpu, select
from worker_mlx.backends.cpu_linear import SmallRowsLinear
from worker_mlx.backends.cpu_rope import TableRoPE
from worker_mlx.kv_pool import MAX_AUTO_SLOTS, KVLayout, pool_size


def test_this_machine_gets_the_cpu_profile():
    backend = select()
    assert backend == cpu.profile()
    assert (backend.name, backend.prefill_step, backend.mem_fraction) == ("cpu", 256, 0.5)
    assert backend.compile_decode and backend.kernels
    plain = select(cpu_kernels=False)  # --disable-cpu-kernels
    assert plain.name == "cpu" and not plain.compile_decode and not plain.kernels


def test_a_gpu_device_gets_the_gpu_profile_of_its_mlx_backend():
    gpu_device = mx.Device(mx.gpu)
    cuda = select(gpu_device, metal=False, cuda=True)  # Linux with mlx[cuda12]
    assert cuda is gpu.CUDA and cuda.name == "cuda"
    metal = select(gpu_device, metal=True, cuda=False)
    assert metal is gpu.METAL and metal.name == "metal"
    for backend in (cuda, metal):
        assert backend.prefill_step == 2048 and backend.mem_fraction == 0.8
        assert not backend.compile_decode
        assert select(mx.gpu, metal=backend is metal, cuda=backend is cuda) is backend
    # the flag is about the CPU only
    assert select(gpu_device, metal=False, cuda=True, cpu_kernels=False) is gpu.CUDA
    # a Mac computing on its CPU is a CPU
    assert select(mx.Device(mx.cpu), metal=True, cuda=False).name == "cpu"
    with pytest.raises(RuntimeError, match="neither a Metal nor a CUDA"):
        select(gpu_device, metal=False, cuda=False)


def _cache_limit() -> int:
    limit = mx.set_cache_limit(0)
    mx.set_cache_limit(limit)
    return limit


@pytest.fixture
def cache_limit():
    """Restores the process's cache limit after the test."""
    before = _cache_limit()
    yield
    mx.set_cache_limit(before)


def test_cpu_install_changes_the_model_and_the_cache_and_undo_restores_them(
    tiny_llama, cache_limit
):
    model, _ = load_model(tiny_llama)
    module = sys.modules[type(model).__module__]
    functions = (module.swiglu, module.scaled_dot_product_attention)
    ropes = [layer.self_attn.rope for layer in model.model.layers]
    assert all(type(r) is nn.RoPE for r in ropes)
    mx.set_cache_limit(64 << 20)

    undo = select().install(model)
    assert _cache_limit() == cpu.BUFFER_CACHE_BYTES
    assert module.swiglu is cpu_kernels.swiglu
    assert module.scaled_dot_product_attention is not functions[1]
    assert all(isinstance(layer.self_attn.rope, TableRoPE) for layer in model.model.layers)
    assert all(type(layer.mlp.down_proj) is SmallRowsLinear for layer in model.model.layers)
    undo()
    assert all(type(layer.mlp.down_proj) is nn.Linear for layer in model.model.layers)
    assert _cache_limit() == 64 << 20
    assert (module.swiglu, module.scaled_dot_product_attention) == functions
    assert [layer.self_attn.rope for layer in model.model.layers] == ropes


def test_cpu_install_never_lowers_the_cache_and_without_kernels_leaves_the_model(
    tiny_model, cache_limit
):
    model, _ = load_model(tiny_model)
    module = sys.modules[type(model).__module__]
    functions = (module.swiglu, module.scaled_dot_product_attention)
    mx.set_cache_limit(2 * cpu.BUFFER_CACHE_BYTES)
    undo = select(cpu_kernels=False).install(model)
    assert _cache_limit() == 2 * cpu.BUFFER_CACHE_BYTES
    assert (module.swiglu, module.scaled_dot_product_attention) == functions
    assert all(type(layer.mlp.down_proj) is nn.Linear for layer in model.model.layers)
    mx.set_cache_limit(64 << 20)
    undo()
    assert _cache_limit() == 2 * cpu.BUFFER_CACHE_BYTES


def test_cpu_max_memory_is_mem_available_less_a_margin():
    """The CPU's default --max-memory: MemAvailable at start less 10%, at least 512 MiB."""
    budget = select().max_memory()
    total = cpu.meminfo("MemTotal")
    assert total is not None  # Linux
    assert 0 < budget <= total - cpu.MIN_MARGIN
    assert cpu.meminfo("NoSuchField") is None
    assert cpu.meminfo("MemTotal", "/nonexistent/meminfo") is None


def test_gpu_max_memory_reads_what_mlx_reports(monkeypatch):
    """The GPU defaults on a CPU-only machine: only mlx's device report is stood in for."""
    active = mx.get_active_memory()
    reports = {
        "cuda": [
            ({"free_memory": 7 << 30, "total_memory": 8 << 30}, (7 << 30) + active),
            ({"total_memory": 8 << 30}, 8 << 30),
            ({"memory_size": 8 << 30}, 8 << 30),
        ],
        "metal": [({"max_recommended_working_set_size": 5 << 30}, 5 << 30)],
    }
    for backend in (gpu.CUDA, gpu.METAL):
        for info, want in reports[backend.name]:
            monkeypatch.setattr(gpu, "device_info", lambda info=info: info)
            assert backend.max_memory() == want
        monkeypatch.setattr(gpu, "device_info", lambda: {"device_name": "?"})
        with pytest.raises(RuntimeError, match="--max-memory"):
            backend.max_memory()


def test_metal_wired_limit_is_the_working_set_and_never_fatal(monkeypatch):
    """As mlx-lm's server: the wired limit is set to the recommended working set; an mlx
    that cannot set it (this CPU-only one has no Metal) only logs a warning."""
    wired = []
    monkeypatch.setattr(gpu, "device_info", lambda: {"max_recommended_working_set_size": 5 << 30})
    monkeypatch.setattr(gpu.mx, "set_wired_limit", wired.append)
    gpu.METAL.wire(1 << 30)
    assert wired == [5 << 30]

    def refuse(limit):
        raise RuntimeError("no Metal here")

    monkeypatch.setattr(gpu.mx, "set_wired_limit", refuse)
    gpu.METAL.wire(1 << 30)  # no exception
    cpu_backend = select()
    cpu_backend.wire(1 << 30)  # the CPU has nothing to wire


def test_pool_sizing_from_a_budget():
    layout = KVLayout(num_layers=2, n_kv_heads=2, head_dim=16, dtype=mx.float16)  # 256 B
    assert pool_size(layout, 0.5, 1 << 20) == (1 << 19) // 256
    assert pool_size(layout, 1.0, 1 << 40) == MAX_AUTO_SLOTS
    with pytest.raises(RuntimeError, match="not enough memory"):
        pool_size(layout, 0.5, 1000)


def test_blas_preload_can_come_before_mlx():
    """The worker preloads OpenBLAS before mlx is imported, so importing the preload (and
    the backends package it lives in) must not import mlx."""
    code = (
        "import sys; import worker_mlx.backends.blas, worker_mlx.backends; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'mlx'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_platform_checks_stand_in_for_the_device():
    """The device decides, not the OS: the `sys.platform` checks left in worker_mlx are about
    the OS itself: blas.py's (mlx on macOS links Accelerate whatever the device) and
    kv_disk_writer.py's writer priority (only Linux gives a thread its own nice value)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "worker_mlx"
    found = [
        str(p.relative_to(root)) for p in root.rglob("*.py") if "sys.platform" in p.read_text()
    ]
    assert sorted(found) == ["backends/blas.py", "kv_disk_writer.py"]
