"""End to end: a real `radix-mlx serve --lora ...` against mlx-lm's own adapter generation."""

from __future__ import annotations

import concurrent.futures
import os
import random
import subprocess

import httpx
import pytest

from common.ipc import free_ports
from tests.server import RADIX_MLX, ServerProcess, log_lines
from tests.test_lora import adapter_greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lora_server(tiny_model, tiny_adapters, tmp_path_factory):
    extra = ["--max-total-tokens", "8192", "--lora", f"a1={tiny_adapters[0]}", "--lora",
             f"a2={tiny_adapters[1]}"]  # fmt: skip
    server = ServerProcess(tiny_model, tmp_path_factory.mktemp("lora") / "server.log", extra)
    server.start()
    yield server
    server.stop()


def _complete(server: ServerProcess, model: str, prompt: list[int], n: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _prompt(seed: int, n: int = 24) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def test_each_adapter_and_the_base_match_mlx_lm(lora_server, tiny_model, tiny_adapters):
    base = os.path.basename(tiny_model)
    prompt = _prompt(1)
    a1, a2 = tiny_adapters
    cases = [(base, None), ("a1", a1), ("a2", a2), (f"{base}:a1", a1)]
    for model, adapter in cases:
        got = _complete(lora_server, model, prompt, 10)["choices"][0]["token_ids"]
        assert got == adapter_greedy(tiny_model, adapter, prompt, 10), model


def test_concurrent_requests_of_two_adapters_and_the_base_match_mlx_lm(
    lora_server, tiny_model, tiny_adapters
):
    base = os.path.basename(tiny_model)
    jobs = [(m, a, _prompt(10 + i)) for i, (m, a) in enumerate(
        [(base, None), ("a1", tiny_adapters[0]), ("a2", tiny_adapters[1])] * 3)]  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: _complete(lora_server, j[0], j[2], 8), jobs))
    for (_, adapter, prompt), res in zip(jobs, results):
        assert res["choices"][0]["token_ids"] == adapter_greedy(tiny_model, adapter, prompt, 8)


def test_a_prefix_cached_under_one_adapter_serves_that_adapter_only(
    lora_server, tiny_model, tiny_adapters
):
    base = os.path.basename(tiny_model)
    prompt = _prompt(99, 40)

    def cached(model: str) -> int:
        res = _complete(lora_server, model, prompt, 4)
        adapter = dict(zip(["a1", "a2"], tiny_adapters)).get(model)
        want = adapter_greedy(tiny_model, adapter, prompt, 4)
        assert res["choices"][0]["token_ids"] == want, model
        return res["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("a1") == 0
    assert cached("a2") == 0
    assert cached(base) == 0
    assert cached("a1") == len(prompt) - 1  # run as a one-token step, with its adapter
    assert cached(base) == len(prompt) - 1


def test_unknown_adapters_are_404s_naming_them(lora_server, tiny_model):
    for name in ("a3", "other:a1", f"{os.path.basename(tiny_model)}:a9"):
        body = {"model": name, "prompt": [5, 6, 7], "max_tokens": 2}
        r = httpx.post(lora_server.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 404, r.text
        assert name in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "model_not_found"


def test_models_lists_the_adapters_with_their_parent(lora_server, tiny_model):
    from openai import OpenAI

    client = OpenAI(base_url=lora_server.url + "/v1", api_key="none")
    cards = {m.id: m for m in client.models.list().data}
    base = os.path.basename(tiny_model)
    assert cards["a1"].parent == base and cards["a2"].parent == base
    assert client.models.retrieve("a2").parent == base
    res = client.completions.create(model="a1", prompt="hello", max_tokens=3, temperature=0)
    assert res.usage.completion_tokens == 3 and res.model == "a1"
    chat = client.chat.completions.create(
        model=f"{base}:a2", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert chat.usage.completion_tokens == 3 and chat.model == "a2"


def test_an_adapter_of_another_base_is_refused_at_start_up(tiny_adapters, model_cache):
    from common.tiny_model import ensure_tiny_model

    other = str(ensure_tiny_model(model_cache, preset="small"))
    port, lora = str(free_ports(1)[0]), f"x={tiny_adapters[0]}"
    out = subprocess.run(
        [RADIX_MLX, "serve", "--model-path", other, "--port", port, "--lora", lora],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0 and "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if "cannot serve this adapter" in line]
    assert len(lines) == 1, out.stderr
    assert "--lora x=" in lines[0] and "an adapter of another base" in lines[0]


def test_an_adapter_loads_at_run_time_beside_the_flags_ones(
    lora_server, tiny_model, tiny_adapters, model_cache
):
    """One model: /admin/loras/load serves a third adapter (mlx-lm's own tokens), which
    runs in the same batches as the others; unloaded, its name is a 404 again."""
    from pathlib import Path

    from common.tiny_adapter import build_tiny_adapter

    path = str(build_tiny_adapter(tiny_model, Path(model_cache) / "lora-tiny-s5", seed=5))
    url = lora_server.url + "/admin/loras/"
    r = httpx.post(url + "load", json={"lora_name": "a5", "lora_path": path}, timeout=60)
    assert r.status_code == 200 and r.json()["parent"] == os.path.basename(tiny_model), r.text
    a1 = tiny_adapters[0]
    jobs = [("a5", path, _prompt(40)), ("a1", a1, _prompt(41)), ("a5", path, _prompt(42))]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: _complete(lora_server, j[0], j[2], 6), jobs))
    for (model, adapter, prompt), res in zip(jobs, results):
        want = adapter_greedy(tiny_model, adapter, prompt, 6)
        assert res["choices"][0]["token_ids"] == want, model
    r = httpx.post(url + "unload", json={"lora_name": "a5"}, timeout=60)
    assert r.status_code == 200, r.text
    body = {"model": "a5", "prompt": [5, 6], "max_tokens": 2}
    assert httpx.post(lora_server.url + "/v1/completions", json=body).status_code == 404
    r = httpx.post(url + "unload", json={"lora_name": "a5"}, timeout=60)
    assert r.status_code == 404 and "a5" in r.text


def test_a_run_time_adapter_is_loaded_again_after_the_worker_restarts(
    lora_server, tiny_model, model_cache
):
    """The restarted pair starts with its --lora adapters only; the router sends it the
    run-time one again under its id: its requests are mlx-lm's tokens once more. (Last in
    the module: it kills the shared server's worker.)"""
    import signal
    import time
    from pathlib import Path

    from common.tiny_adapter import build_tiny_adapter

    path = str(build_tiny_adapter(tiny_model, Path(model_cache) / "lora-tiny-s6", seed=6))
    body = {"lora_name": "a6", "lora_path": path}
    assert httpx.post(lora_server.url + "/admin/loras/load", json=body, timeout=60).is_success
    os.kill(lora_server.child("worker"), signal.SIGKILL)
    prompt, want = _prompt(60), adapter_greedy(tiny_model, path, _prompt(60), 6)
    deadline, status = time.monotonic() + 120, None
    while time.monotonic() < deadline:
        req = {"model": "a6", "prompt": prompt, "max_tokens": 6, "temperature": 0,
               "ignore_eos": True}  # fmt: skip
        r = httpx.post(lora_server.url + "/v1/completions", json=req, timeout=60)
        status = r.status_code
        if status == 200:
            assert r.json()["choices"][0]["token_ids"] == want
            break
        time.sleep(0.2)  # restarting (503), or the adapter not sent again yet (404)
    assert status == 200
    assert log_lines(lora_server, "LoRA adapter a6 loaded again")
