"""POST /v1/embeddings end to end: a real server on a tiny sentence-transformers model,
the official openai SDK as the client, mlx-lm's hidden states as the reference."""

from __future__ import annotations

import asyncio
import base64
import re

import httpx
import numpy as np
import openai
import pytest

from router.client import AsyncClient
from tests.conftest import mlx_greedy
from tests.server import checked_server, log_lines
from tests.test_embed_pass import build_body_only, reference

pytestmark = pytest.mark.slow

CONTEXT = 256
TEXTS = ["The quick brown fox", "jumps over the lazy dog", "a"]


@pytest.fixture(scope="module")
def embed_model(model_cache) -> str:
    from common.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model(model_cache, preset="tiny", arch="qwen3", embedding=True))


@pytest.fixture(scope="module")
def server(embed_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("embeddings") / "server.log"
    extra = ["--max-total-tokens", "512", "--context-length", str(CONTEXT),
             "--served-model-name", "m"]  # fmt: skip
    with checked_server(embed_model, log, extra) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none")


def encode(path: str, text: str) -> list[int]:
    from tests.conftest import load_model

    return load_model(path)[1].encode(text)


def test_sdk_float_and_base64_equal_the_reference(server, client, embed_model):
    floats = client.embeddings.create(model="m", input=TEXTS, encoding_format="float")
    packed = client.embeddings.create(model="m", input=TEXTS)  # the SDK asks for base64
    ids = [encode(embed_model, t) for t in TEXTS]
    n = sum(map(len, ids))
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == n
    line = rf"POST /v1/embeddings 200, latency: \S+ s, #prompt-token: {n}, #cached-token: 0,"
    assert log_lines(server, line)
    assert [d.index for d in floats.data] == [0, 1, 2]
    for a, b, row in zip(floats.data, packed.data, ids):
        want = reference(embed_model, row, "last")
        np.testing.assert_allclose(a.embedding, want, atol=1e-4)
        np.testing.assert_allclose(b.embedding, a.embedding, atol=1e-7)


def test_token_id_inputs_and_raw_base64_bytes(server, embed_model):
    rows = [encode(embed_model, t) for t in TEXTS]
    one = httpx.post(server.url + "/v1/embeddings", json={"input": rows[0]}).json()
    many = httpx.post(
        server.url + "/v1/embeddings", json={"input": rows, "encoding_format": "base64"}
    ).json()
    np.testing.assert_allclose(one["data"][0]["embedding"], reference(embed_model, rows[0], "last"),
                               atol=1e-4)  # fmt: skip
    for item, row in zip(many["data"], rows):
        vector = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
        np.testing.assert_allclose(vector, reference(embed_model, row, "last"), atol=1e-4)


def test_batched_equals_one_by_one(client):
    together = client.embeddings.create(model="m", input=TEXTS, encoding_format="float").data

    async def alone():
        aclient = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="none")
        return await asyncio.gather(
            *(aclient.embeddings.create(model="m", input=t, encoding_format="float") for t in TEXTS)
        )

    for joint, single in zip(together, asyncio.run(alone())):
        np.testing.assert_allclose(joint.embedding, single.data[0].embedding, atol=1e-5)


def test_dimensions_truncate_and_renormalize(client, embed_model):
    got = client.embeddings.create(model="m", input=TEXTS[0], dimensions=16,
                                   encoding_format="float").data[0].embedding  # fmt: skip
    full = reference(embed_model, encode(embed_model, TEXTS[0]), "last")
    assert len(got) == 16
    np.testing.assert_allclose(got, full[:16] / np.linalg.norm(full[:16]), atol=1e-4)


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"input": ""}, "input", "empty"),
        ({"input": []}, "input", "empty"),
        ({"input": [[1, 2], []]}, "input", "input[1] is empty"),
        ({"input": [5, 10**6]}, "input", "token ids must be in"),
        ({"input": [[-1]]}, "input", "token ids must be in"),
        ({"input": [5] * (CONTEXT + 1)}, "input", "context"),
        ({"input": ["x"] * 2049}, "input", "at most 2048"),
        ({"input": "x", "dimensions": 0}, "dimensions", "between 1 and the model's 64"),
        ({"input": "x", "dimensions": 65}, "dimensions", "between 1 and the model's 64"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", "base64"),
        ({"input": 5}, "input", "a list of token ids"),
        ({"input": [1, "a"]}, "input", "a list of token ids"),
        ({"input": [[1], [2.5]]}, "input", "a list of token ids"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, body, param, words):
    reply = httpx.post(server.url + "/v1/embeddings", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_unknown_model_is_a_404(server):
    reply = httpx.post(server.url + "/v1/embeddings", json={"input": "x", "model": "nope"})
    assert reply.status_code == 404 and "'nope'" in reply.json()["error"]["message"]


def test_embeddings_never_evict_cached_prefixes(server, embed_model):
    """The pool holds 512 tokens; embeddings of 6 x 250 tokens while a generation runs
    leave a cached prompt cached, and the model generates too."""
    prompt = encode(embed_model, "a system prompt that stays cached " * 6)

    def complete(max_tokens: int) -> dict:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        return httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()

    complete(1)
    before = complete(1)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert before == len(prompt) - 1

    async def together():
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=120) as http,
            AsyncClient(server.zmq_address, timeout=120) as sdk,
        ):
            stream = sdk.stream(input_ids=[7] * 100, max_new_tokens=150, temperature=0,
                                ignore_eos=True)  # fmt: skip
            first = await anext(stream)  # it runs: the embeddings come while it decodes
            embeds = asyncio.gather(
                *(http.post("/v1/embeddings", json={"input": [[i + 3] * 250] * 2})
                  for i in range(3))
            )  # fmt: skip
            tokens = first.token_ids + [t for c in [c async for c in stream] for t in c.token_ids]
            return tokens, await embeds

    generated, replies = asyncio.run(together())
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    assert re.search(r"Embed batch, #row: \d+, #token: \d+, #queue-row: \d+, #running-req: 1",
                     server.log())  # fmt: skip
    # decode steps (and those computed ahead) between embed steps stay mlx-lm's
    assert generated == mlx_greedy(embed_model, [7] * 100, 150)
    assert complete(1)["usage"]["prompt_tokens_details"]["cached_tokens"] == before
    metrics = httpx.get(server.url + "/metrics").text
    assert re.search(r'radix_mlx_evicted_tokens_total\{replica="r0"\} 0\.0', metrics)
    requests = re.search(r'radix_mlx_embedding_requests_total\{replica="r0"\} (\S+)', metrics)
    tokens = re.search(r'radix_mlx_embedding_tokens_total\{replica="r0"\} (\S+)', metrics)
    assert float(requests.group(1)) >= 3 and float(tokens.group(1)) >= 1500


def test_a_body_only_checkpoint_serves_embeddings_and_refuses_generation(tmp_path_factory):
    """Qwen3-Embedding-4B/8B's kind of checkpoint: no LM head. Embeddings as the full
    model's; generation is a 400 that says why, on every generation endpoint."""
    full, body = build_body_only(tmp_path_factory.mktemp("body-only"))
    log = tmp_path_factory.mktemp("body-only-server") / "server.log"
    with checked_server(body, log, ["--max-total-tokens", "512"]) as srv:
        ids = encode(full, TEXTS[0])
        got = httpx.post(srv.url + "/v1/embeddings", json={"input": ids}).json()
        np.testing.assert_allclose(got["data"][0]["embedding"], reference(full, ids, "last"),
                                   atol=1e-4)  # fmt: skip
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for path, body_ in [("/v1/chat/completions", chat), ("/v1/completions", {"prompt": "hi"})]:
            reply = httpx.post(srv.url + path, json=body_)
            assert reply.status_code == 400, reply.text
            assert "serves /v1/embeddings only" in reply.json()["error"]["message"]
