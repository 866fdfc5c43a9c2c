"""End to end: one `radix-mlx serve` with two models (a tiny Qwen3 and a tiny Llama)
loaded on demand under --max-loaded-models 1: greedy parity with mlx-lm for each, loads
and unloads that never cut a request short, /v1/models' loaded flags, the admin
endpoints behind the API key, a hot swap under load, and the refusals."""

from __future__ import annotations

import concurrent.futures
import os
import random
import re
import signal
import subprocess
import threading
import time

import httpx
import pytest

from common.ipc import free_ports
from router.client import Client, RadixMLXError
from tests.conftest import mlx_greedy
from tests.server import RADIX_MLX, checked_server, log_lines

pytestmark = pytest.mark.slow
KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def two_models(tiny_model, tiny_llama, tmp_path_factory):
    """Both models behind one server, one loaded at a time; it must outlive the tests
    and log no traceback (checked_server)."""
    log = tmp_path_factory.mktemp("models") / "server.log"
    extra = [
        "--model-path", tiny_llama, "--max-loaded-models", "1", "--max-total-tokens", "4096",
        "--models-memory-budget", "4GiB", "--restart-wait-timeout", "120", "--api-key", KEY,
    ]  # fmt: skip
    with checked_server(tiny_model, log, extra) as server:
        yield server, {os.path.basename(tiny_model): tiny_model,
                       os.path.basename(tiny_llama): tiny_llama}  # fmt: skip


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(rng.randrange(4, 40))]


def _complete(server, model: str, prompt, max_tokens: int = 8) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    return httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=180)


def _loaded(server) -> dict[str, bool]:
    r = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    return {card["id"]: card["loaded"] for card in r.json()["data"]}


def _admin(server, action: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{server.url}/admin/models/{action}", json=body, headers=headers,
                      timeout=180)  # fmt: skip


def test_alternating_requests_match_mlx_lm_and_load_on_demand(two_models):
    server, models = two_models
    names = sorted(models)
    for i in range(4):
        name = names[i % 2]
        prompt = _prompt(i)
        r = _complete(server, name, prompt)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == name
        assert r.json()["choices"][0]["token_ids"] == mlx_greedy(models[name], prompt, 8)
        assert _loaded(server) == {n: n == name for n in names}  # one at a time
    log = server.log()
    for name in names:
        assert re.search(rf"model {re.escape(name)} loaded in [\d.]+ s", log)
        assert re.search(rf"unloading model {re.escape(name)} \(to make room", log)
    assert "gets --max-memory" in log  # each pool is sized from what the budget leaves
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert re.search(r'radix_mlx_model_evictions_total\{model="[^"]+"\} [1-9]', metrics)
    assert re.search(r'radix_mlx_generation_tokens_total\{model="[^"]+",replica="r0"\}', metrics)
    assert "radix_mlx_model_load_seconds_count" in metrics


def test_a_model_is_not_unloaded_under_its_request(two_models):
    """A long request to one model, then one to the other: the second waits for the
    first to finish (one model at a time), and both succeed."""
    server, models = two_models
    loaded = _loaded(server)
    busy, other = sorted(models, key=lambda n: loaded[n], reverse=True)
    prompt = _prompt(10)
    prefills = server.log().count("Prefill batch")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        long = pool.submit(_complete, server, busy, prompt, 300)
        while server.log().count("Prefill batch") == prefills:
            time.sleep(0.02)  # until the long request runs
        short = pool.submit(_complete, server, other, _prompt(11))
        first, second = long.result(), short.result()
    assert first.status_code == 200 and second.status_code == 200, (first.text, second.text)
    assert first.json()["choices"][0]["token_ids"] == mlx_greedy(models[busy], prompt, 300)
    assert re.search(rf"unloading model {re.escape(busy)} \(to make room for "
                     rf"{re.escape(other)}; 0 request", server.log())  # fmt: skip


def test_admin_endpoints_need_the_key_and_load_and_unload(two_models):
    server, models = two_models
    name = sorted(models)[0]
    assert _admin(server, "load", {"model": name}, headers={}).status_code == 401
    r = _admin(server, "load", {"model": name})
    assert r.status_code == 200 and r.json()["loaded"] is True, r.text
    assert _loaded(server)[name] is True
    r = _admin(server, "unload", {"model": name})
    assert r.status_code == 200 and r.json()["loaded"] is False, r.text
    assert _loaded(server)[name] is False
    r = _admin(server, "load", {"model": "no-such-model"})
    assert r.status_code == 404 and "no-such-model" in r.json()["error"]["message"]
    assert _admin(server, "load", {}).status_code == 400
    health = httpx.get(server.url + "/health", timeout=10).json()
    assert health["status"] == "ok" and {m["id"] for m in health["models"]} == set(models)


def test_the_sdk_names_its_model(two_models):
    server, models = two_models
    prompt = _prompt(40)
    with Client(server.zmq_address, timeout=180, api_key=KEY) as client:
        for name in sorted(models):
            res = client.generate(input_ids=prompt, model=name, max_new_tokens=8,
                                  temperature=0.0, ignore_eos=True)  # fmt: skip
            assert res.output_ids == mlx_greedy(models[name], prompt, 8)
        with pytest.raises(RadixMLXError) as err:
            client.generate(input_ids=prompt, model="gpt-17", max_new_tokens=2)
    assert err.value.status == 404 and "'gpt-17' does not exist" in str(err.value)


def test_unknown_model_is_a_404_naming_it(two_models):
    server, _ = two_models
    r = _complete(server, "gpt-17", [5, 6, 7])
    assert r.status_code == 404
    assert "'gpt-17' does not exist" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/models/gpt-17", headers=AUTH, timeout=10)
    assert r.status_code == 404


def test_hot_swap_under_load_fails_nothing(two_models):
    """Four clients send requests back to back from before the swap until after it: every
    one is answered, token-exact, by the old pair or the new one."""
    server, models = two_models
    name = sorted(models)[1]
    assert _complete(server, name, _prompt(20)).status_code == 200  # loaded
    swapped = threading.Event()

    def client(seed: int) -> list[tuple[list[int], httpx.Response]]:
        out, after = [], 0
        while after < 2:  # two more once the new pair took over
            after += swapped.is_set()
            prompt = _prompt(seed * 100 + len(out))
            out.append((prompt, _complete(server, name, prompt, 32)))
        return out

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        clients = [pool.submit(client, seed) for seed in range(4)]
        swap = _admin(server, "load", {"model": name, "reload": True})
        swapped.set()
        done = [pair for c in clients for pair in c.result()]
    assert swap.status_code == 200, swap.text
    assert [r.status_code for _, r in done] == [200] * len(done), [r.text for _, r in done]
    for prompt, r in done:
        assert r.json()["choices"][0]["token_ids"] == mlx_greedy(models[name], prompt, 32)
    assert log_lines(server, rf"model {re.escape(name)}: the old version stopped \(0 request")


def test_a_new_path_under_a_name_serves_its_weights(two_models):
    server, models = two_models
    name, other = sorted(models)
    prompt = _prompt(50)
    for path in (models[other], models[name]):  # the other model's weights, then back
        r = _admin(server, "load", {"model": name, "path": path})
        assert r.status_code == 200 and r.json()["loaded"] is True, r.text
        r = _complete(server, name, prompt)
        assert r.status_code == 200 and r.json()["model"] == name, r.text
        assert r.json()["choices"][0]["token_ids"] == mlx_greedy(path, prompt, 8)
    r = _admin(server, "load", {"model": name, "path": "/no/such/dir"})
    assert r.status_code == 400 and "/no/such/dir" in r.json()["error"]["message"]


def test_a_model_over_the_budget_is_refused_with_the_sizes(tiny_model, tiny_llama):
    port, zmq_port = free_ports(2)
    out = subprocess.run(
        [RADIX_MLX, "serve", "--model-path", tiny_model, "--model-path", tiny_llama,
         "--models-memory-budget", "100KiB", "--port", str(port), "--zmq-port", str(zmq_port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )  # fmt: skip
    assert out.returncode == 1, out.stdout
    assert re.search(r"does not fit: its weights alone are \d+ KiB, over "
                     r"--models-memory-budget 100 KiB", out.stdout), out.stdout  # fmt: skip


def test_idle_models_unload_and_pinned_ones_stay(tiny_model, tiny_llama, tmp_path):
    """And a request that waits longer than --restart-wait-timeout for its model gets a
    503 with Retry-After, while the load goes on; a model whose pair crash-loops
    (--max-restarts 0: at its first death) is unloaded, and loads again when asked. Two
    models share --models-memory-budget."""
    pinned, other = os.path.basename(tiny_model), os.path.basename(tiny_llama)
    extra = [
        "--model-path", tiny_llama, "--pin-model", pinned, "--model-idle-timeout", "2",
        "--max-loaded-models", "2", "--max-total-tokens", "4096", "--restart-wait-timeout",
        "0.2", "--max-restarts", "0", "--models-memory-budget", "3GiB",
    ]  # fmt: skip
    with checked_server(tiny_model, tmp_path / "server.log", extra) as server:
        assert _loaded(server) == {pinned: True, other: False}  # the pinned one at start
        r = _complete(server, other, _prompt(30))
        assert r.status_code == 503 and r.headers["Retry-After"] == "5", r.text
        assert f"model '{other}' is loading" in r.json()["error"]["message"]
        assert log_lines(server, rf"model {re.escape(other)} loaded in", timeout=60)
        assert _complete(server, other, _prompt(30)).status_code == 200
        # two at once: each worker got half the budget (what the other's measured one left)
        for name in (pinned, other):
            assert re.search(rf"model {re.escape(name)} gets --max-memory 1\.5 GiB", server.log())
        unloaded = log_lines(server, rf"unloading model {re.escape(other)} \(idle for 2 s")
        assert unloaded, server.log()
        assert _loaded(server) == {pinned: True, other: False}
        r = _admin(server, "unload", {"model": pinned}, headers={})
        assert r.status_code == 400 and "pinned" in r.json()["error"]["message"]
        assert f"unloading model {pinned}" not in server.log()
        os.kill(server.child(f"worker-{pinned}"), signal.SIGKILL)
        assert log_lines(server, rf"unloading model {re.escape(pinned)} \(its processes crash")
        assert _loaded(server)[pinned] is False
        r = _admin(server, "load", {"model": pinned}, headers={})
        assert r.status_code == 200 and r.json()["loaded"] is True, r.text
        assert _complete(server, pinned, _prompt(31)).status_code == 200


def test_an_adapter_loaded_while_its_model_is_not_loads_with_it(
    two_models, tiny_model, tiny_adapters
):
    """/admin/loras/load for a model that is not loaded (one at a time here) checks the
    adapter against its files and keeps it: the model's next load serves it, token-exact
    against mlx-lm with the adapter."""
    from tests.test_lora import adapter_greedy

    server, models = two_models
    qwen = os.path.basename(tiny_model)
    other = next(name for name in models if name != qwen)
    assert _complete(server, other, [5, 6, 7]).status_code == 200  # qwen is not loaded now
    body = {"lora_name": f"{qwen}:late", "lora_path": tiny_adapters[1]}
    r = httpx.post(server.url + "/admin/loras/load", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["loaded"] is False, r.text
    prompt = _prompt(31)
    r = _complete(server, "late", prompt, 6)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == adapter_greedy(
        tiny_model, tiny_adapters[1], prompt, 6
    )
    r = httpx.post(server.url + "/admin/loras/unload", json={"lora_name": "late"},
                   headers=AUTH, timeout=60)  # fmt: skip
    assert r.status_code == 200 and "late" not in _loaded(server)
