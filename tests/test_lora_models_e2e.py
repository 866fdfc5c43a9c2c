"""End to end: the issue's "done when". One `radix-mlx serve` with a chat model (a tiny
Qwen3), a side model (a tiny Llama), an embedding model and two LoRA adapters of the chat
model, loaded on demand: greedy parity with mlx-lm for each model and with
`mlx_lm.load(path, adapter_path=...)` for each adapter, embeddings equal to mlx-lm's
pooled hidden states; then adapters loaded and unloaded at run time (/admin/loras/*)."""

from __future__ import annotations

import concurrent.futures
import os
import random
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from common.tiny_adapter import build_tiny_adapter
from tests.server import checked_server, log_lines
from tests.test_embed_pass import reference
from tests.test_lora import adapter_greedy

pytestmark = pytest.mark.slow
KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def embed_model(model_cache) -> str:
    from common.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model(model_cache, preset="tiny", arch="qwen3", embedding=True))


@pytest.fixture(scope="module")
def served(tiny_model, tiny_llama, embed_model, tiny_adapters, tmp_path_factory):
    """(server, {model id: (model dir, adapter dir or None)}); it must outlive the tests."""
    chat, side, embed = (os.path.basename(p) for p in (tiny_model, tiny_llama, embed_model))
    extra = [
        "--model-path", tiny_llama, "--model-path", embed_model,
        "--lora", f"{chat}:a1={tiny_adapters[0]}", "--lora", f"{chat}:a2={tiny_adapters[1]}",
        "--max-total-tokens", "2048", "--restart-wait-timeout", "120", "--api-key", KEY,
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("lora-models") / "server.log"
    with checked_server(tiny_model, log, extra) as server:
        yield server, {
            chat: (tiny_model, None), side: (tiny_llama, None), embed: (embed_model, None),
            "a1": (tiny_model, tiny_adapters[0]), f"{chat}:a2": (tiny_model, tiny_adapters[1]),
        }  # fmt: skip


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key=KEY, max_retries=0)


def _prompt(seed: int, n: int = 20) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def _tokens(client, model: str, prompt: list[int], n: int = 6) -> tuple[list[int], int]:
    """(the greedy completion's token ids, its cached prompt tokens)."""
    res = client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    return res.choices[0].token_ids, res.usage.prompt_tokens_details.cached_tokens


def test_each_model_and_adapter_matches_mlx_lm_and_embeddings_are_right(served, client):
    server, models = served
    prompt = _prompt(1)
    for model, (path, adapter) in models.items():
        if "embed" in model:
            continue
        got, _ = _tokens(client, model, prompt)
        assert got == adapter_greedy(path, adapter, prompt, 6), model
    embed, (embed_dir, _) = next((m, v) for m, v in models.items() if "embed" in m)
    out = client.embeddings.create(model=embed, input=[prompt, prompt[:7]])
    for item, row in zip(out.data, [prompt, prompt[:7]]):
        np.testing.assert_allclose(item.embedding, reference(embed_dir, row, "last"), atol=1e-4)
    with pytest.raises(openai.BadRequestError, match="LoRA adapter, which does not embed"):
        client.embeddings.create(model="a1", input="x")
    listed = {m.id: m.model_extra for m in client.models.list().data}
    assert set(listed) >= {*models, "a2"} - {next(m for m in models if ":" in m)}
    assert listed["a1"]["parent"] == listed["a2"]["parent"] == os.path.basename(models["a1"][0])


def _admin(server, action: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{server.url}/admin/loras/{action}", json=body, headers=headers,
                      timeout=120)  # fmt: skip


def test_an_adapter_loads_and_unloads_at_run_time(served, client, tiny_model, model_cache):
    server, _ = served
    path = str(build_tiny_adapter(tiny_model, Path(model_cache) / "lora-tiny-s7", seed=7))
    body = {"lora_name": f"{os.path.basename(tiny_model)}:a7", "lora_path": path}
    assert _admin(server, "load", body, {}).status_code == 401
    r = _admin(server, "load", body)
    assert r.status_code == 200, r.text
    assert r.json()["parent"] == os.path.basename(tiny_model)
    prompt = _prompt(2)
    assert _tokens(client, "a7", prompt)[0] == adapter_greedy(tiny_model, path, prompt, 6)
    assert log_lines(server, "LoRA adapter a7 loaded")
    r = _admin(server, "unload", {"lora_name": "a7"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError, match="a7"):
        _tokens(client, "a7", prompt)


def test_a_reloaded_name_never_sees_the_old_adapters_prefixes(
    served, client, tiny_model, tiny_adapters
):
    """`x` is a1's weights, then (unloaded, loaded again) a2's: the prompt cached under the
    first must not serve the second (its id is new, so is its radix namespace)."""
    server, _ = served
    prompt, name = _prompt(3, 40), f"{os.path.basename(tiny_model)}:x"
    for adapter in tiny_adapters:
        assert _admin(server, "load", {"lora_name": name, "lora_path": adapter}).status_code == 200
        got, cached = _tokens(client, "x", prompt, 4)
        assert got == adapter_greedy(tiny_model, adapter, prompt, 4)
        assert cached == 0
        assert _tokens(client, "x", prompt, 4) == (got, len(prompt) - 1)  # its own prefix
        assert _admin(server, "unload", {"lora_name": name}).status_code == 200


def test_bad_adapter_loads_and_unloads_are_refused_with_the_reason(
    served, tiny_model, tiny_llama, model_cache
):
    server, _ = served
    from common.tiny_model import ensure_tiny_model

    other = str(ensure_tiny_model(model_cache, preset="small"))
    wrong = str(build_tiny_adapter(other, Path(model_cache) / "lora-small-s1", seed=1))
    chat = os.path.basename(tiny_model)
    r = _admin(server, "load", {"lora_name": f"{chat}:w", "lora_path": wrong})
    assert r.status_code == 400 and "cannot serve this adapter: it adapts" in r.text, r.text
    r = _admin(server, "unload", {"lora_name": "nothing"})
    assert r.status_code == 404 and "nothing" in r.text
    r = _admin(server, "load", {"lora_name": "nobase:w", "lora_path": wrong})
    assert r.status_code == 404 and "nobase" in r.text
    r = _admin(server, "load", {"lora_name": "a1", "lora_path": wrong})
    assert r.status_code == 400 and "a1" in r.text


def test_an_unload_waits_for_the_adapters_requests_in_flight(served, client, tiny_model):
    """The unload is asked for while the adapter's request streams; the adapter goes only
    after that request ended (the log's order), which ran it to its end."""
    server, models = served
    chat, adapter = os.path.basename(tiny_model), models["a1"][1]
    name, n = f"{chat}:busy", 600
    assert _admin(server, "load", {"lora_name": name, "lora_path": adapter}).status_code == 200
    prompt = _prompt(4)
    stream = client.completions.create(model="busy", prompt=prompt, max_tokens=n,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    tokens = list(next(stream).choices[0].token_ids)  # it runs: now unload its adapter
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        unloading = pool.submit(_admin, server, "unload", {"lora_name": name})
        for chunk in stream:
            tokens += chunk.choices[0].token_ids
        assert unloading.result().status_code == 200
    assert tokens == adapter_greedy(tiny_model, adapter, prompt, n)
    ended = log_lines(server, rf"POST /v1/completions 200.*#generated-token: {n}\b")
    unloaded = log_lines(server, "LoRA adapter busy unloaded")
    lines = server.log().splitlines()
    assert lines.index(ended[-1]) < lines.index(unloaded[-1])
