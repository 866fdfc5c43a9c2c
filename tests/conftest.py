"""Shared fixtures: tiny models built offline, mlx-lm reference generation, real servers."""

from __future__ import annotations

import os

from worker_mlx.backends.blas import preload_openblas

preload_openblas()  # before anything imports mlx

import functools  # noqa: E402

import pytest  # noqa: E402

from common.server_args import ServerArgs  # noqa: E402
from tests.scripted_worker import VOCAB, SchedulerHarness  # noqa: E402
from tests.server import ServerProcess  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> str:
    return os.environ.get("RADIX_MLX_TEST_CACHE") or str(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_model(model_cache) -> str:
    """The default tiny Qwen3 model directory."""
    from common.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model(model_cache, preset="tiny", arch="qwen3"))


@pytest.fixture(scope="session")
def tiny_llama(model_cache) -> str:
    """A tiny Llama with grouped-query attention (4 heads, 2 KV heads)."""
    from common.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model(model_cache, preset="tiny", arch="llama"))


@pytest.fixture(scope="session")
def tiny_adapters(tiny_model, model_cache) -> list[str]:
    """Two seeded LoRA adapters of the tiny model (q_proj and v_proj of both layers)."""
    from pathlib import Path

    from common.tiny_adapter import build_tiny_adapter

    return [
        str(build_tiny_adapter(tiny_model, Path(model_cache) / f"lora-tiny-s{seed}", seed=seed))
        for seed in (1, 2)
    ]


@pytest.fixture(scope="session")
def agent_model(tiny_model, model_cache) -> str:
    """The tiny model with thinking and tool-call tokens and a tools-aware chat template."""
    from pathlib import Path

    from tests.agent_model import build_agent_model

    return build_agent_model(tiny_model, Path(model_cache) / "agent-tiny-qwen3")


@pytest.fixture(scope="session")
def scripted_agent_model(tiny_model, model_cache) -> str:
    """A tiny model that calls a tool it knows, then answers (tests/scripted_agent_model.py)."""
    from pathlib import Path

    from tests.scripted_agent_model import build_scripted_agent_model

    return build_scripted_agent_model(tiny_model, Path(model_cache) / "scripted-agent-qwen3")


@functools.cache
def load_model(path: str):
    from mlx_lm import load

    return load(path)


def mlx_greedy(path: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's own greedy generation: the reference every parity test compares with."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model, _ = load_model(path)
    out = []
    for tok, _ in generate_step(
        mx.array(prompt_ids), model, max_tokens=max_tokens, sampler=lambda x: mx.argmax(x, -1)
    ):
        out.append(int(tok))
    return out


def runner_greedy(model, prompts: list[list[int]], steps: int, pool_slots: int) -> list[list[int]]:
    """The worker's ModelRunner generating greedily for `prompts` batched together (one
    extend, then decode steps), in a pool of `pool_slots`: what parity tests set against
    mlx_greedy."""
    from common.messages import DecodeBatch, ExtendBatch, ExtendReq, SamplingParams
    from worker_mlx.kv_pool import MlxKVPool
    from worker_mlx.model_probe import probe_kv_layout
    from worker_mlx.model_runner import ModelRunner

    runner = ModelRunner(model, MlxKVPool(probe_kv_layout(model), pool_slots), 512)
    slots = iter(range(1, pool_slots + 1))
    params = SamplingParams(temperature=0, max_new_tokens=steps)
    reqs = [
        ExtendReq(f"r{i}", p, [], [next(slots) for _ in p], params) for i, p in enumerate(prompts)
    ]
    rids = [r.rid for r in reqs]
    out = runner.extend(ExtendBatch(0, reqs))
    got = [[t] for t in out.next_token_ids]
    for step in range(1, steps):
        out = runner.decode(DecodeBatch(step, rids, [next(slots) for _ in rids]))
        for row, t in zip(got, out.next_token_ids):
            row.append(t)
    return got


def _serve(model: str, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    server = ServerProcess(model, log, extra=["--max-total-tokens", "8192"])
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiny_server(tiny_model, tmp_path_factory):
    """A real `radix-mlx serve` on the tiny model, shared by a test module."""
    yield from _serve(tiny_model, tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_arch(model_cache):
    """Factory: ``tiny_arch("gemma3")`` is that family's tiny model dir, built once per cache.

    The families are ``common.tiny_model.ARCHES`` (see ``common/tiny_families.py``).
    """
    from common.tiny_model import ensure_tiny_model

    def build(arch: str, preset: str = "tiny") -> str:
        return str(ensure_tiny_model(model_cache, preset=preset, arch=arch))

    return build


@pytest.fixture
def make_harness(request):
    """Start a scheduler process with a scripted worker; it is always stopped afterwards."""

    def make(
        num_slots: int, *, context_len: int = 4096, num_state_slots: int = 0, **kw
    ) -> SchedulerHarness:
        kw.setdefault("log_level", "info")
        args = ServerArgs(model_path="scripted", debug_invariants=True, **kw)
        h = SchedulerHarness(
            args,
            num_slots,
            vocab_size=VOCAB,
            context_len=context_len,
            num_state_slots=num_state_slots,
        )
        request.addfinalizer(h.close)
        return h.start()

    return make


@pytest.fixture(scope="session")
def tiny_llama_bos(model_cache) -> str:
    """A tiny Llama whose tokenizer adds a BOS through its post-processor and whose chat
    template starts with ``{{ bos_token }}``, as Llama 3's do."""
    from common.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model(model_cache, preset="tiny", arch="llama", bos=True))


@pytest.fixture(scope="module")
def bos_server(tiny_llama_bos, tmp_path_factory):
    """A real `radix-mlx serve` on the BOS model, shared by a test module."""
    yield from _serve(tiny_llama_bos, tmp_path_factory)


@pytest.fixture(scope="module", params=["no-bos", "bos"])
def parity_server(request):
    """(server, model dir) on the default tiny model and then on the BOS model: a parity
    test that takes it runs against both kinds of tokenizer."""
    if request.param == "bos":
        return request.getfixturevalue("bos_server"), request.getfixturevalue("tiny_llama_bos")
    return request.getfixturevalue("tiny_server"), request.getfixturevalue("tiny_model")


@pytest.fixture(scope="session")
def tiny_vlm(model_cache) -> str:
    """The tiny Qwen2.5-VL model directory (mlx-vlm's classes, random weights)."""
    from common.tiny_vlm import ensure_tiny_vlm

    return str(ensure_tiny_vlm(model_cache, arch="qwen2_5_vl"))


@functools.cache
def load_vlm(path: str):
    from mlx_vlm import load

    return load(path)


def random_image(seed: int, height: int = 80, width: int = 100):
    """A seeded random RGB picture (PIL), the same for the same arguments."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def vlm_greedy(path: str, messages: list[dict], images: list, max_tokens: int) -> list[int]:
    """mlx-vlm's own greedy generation for a chat with images: the vision reference."""
    from mlx_vlm import generate

    model, processor = load_vlm(path)
    prompt = processor.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    result = generate(
        model, processor, prompt, image=images or None, max_tokens=max_tokens, temperature=0.0
    )
    return list(result.token_ids)
