"""Tenants share a cache only when they mean to, against a real server on the tiny model:
vLLM's `cache_salt` on every endpoint (official `openai` and `anthropic` SDKs, raw HTTP,
the ZMQ SDK), `--cache-salt-header` overriding it, and Anthropic `cache_control`
breakpoints kept cached when a full pool makes eviction choose."""

from __future__ import annotations

import random

import anthropic
import httpx
import openai
import pytest

from radix_mlx import Client
from tests.server import checked_server

pytestmark = pytest.mark.slow

HEADER = "X-Tenant-Salt"
POOL = 640  # tokens: small, so the priority test can fill it


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("tenancy") / "server.log"
    extra = [
        "--max-total-tokens",
        str(POOL),
        "--cache-salt-header",
        HEADER,
        "--served-model-name",
        "m",
    ]
    with checked_server(tiny_model, log, extra) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0) as client:
        yield client


def _prompt(seed: int, n: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def completion_cached(server, prompt, salt=None, headers=None) -> int:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_completions_share_only_under_the_same_salt(server):
    prompt = _prompt(1)
    assert completion_cached(server, prompt, "tenant-a") == 0
    assert completion_cached(server, prompt, "tenant-b") == 0  # same prompt, other salt
    assert completion_cached(server, prompt) == 0  # the shared cache is not a tenant's
    assert completion_cached(server, prompt, "tenant-a") == len(prompt) - 1
    assert completion_cached(server, prompt) == len(prompt) - 1  # unsalted share as before


def test_chat_and_messages_take_the_salt(oai, claude):
    def chat(salt):
        out = oai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "salted chat " * 8}],
            max_tokens=1, temperature=0, extra_body={"cache_salt": salt},
        )  # fmt: skip
        return out.usage.prompt_tokens_details.cached_tokens

    assert chat("c1") == 0 and chat("c2") == 0 and chat("c1") > 0

    def message(salt):
        out = claude.messages.create(
            model="m", max_tokens=1, messages=[{"role": "user", "content": "salted msg " * 8}],
            extra_body={"cache_salt": salt, "temperature": 0.0},
        )  # fmt: skip
        return out.usage.cache_read_input_tokens

    assert message("m1") == 0 and message("m2") == 0 and message("m1") > 0
    count = claude.messages.count_tokens(
        model="m", messages=[{"role": "user", "content": "hi"}], extra_body={"cache_salt": "m1"}
    )
    assert count.input_tokens > 0  # count_tokens takes it and ignores it


def test_the_gateway_header_overrides_the_body(server):
    prompt = _prompt(2)
    assert completion_cached(server, prompt, "body-salt") == 0
    # the header wins: the body's salt, which would hit, is not used
    assert completion_cached(server, prompt, "body-salt", {HEADER: "gw-1"}) == 0
    assert completion_cached(server, prompt, "other", {HEADER: "gw-1"}) == len(prompt) - 1
    assert completion_cached(server, prompt, None, {HEADER: "body-salt"}) == len(prompt) - 1
    assert completion_cached(server, prompt, None, {HEADER: ""}) == 0  # empty: the shared one


@pytest.mark.parametrize(
    "path, body, headers",
    [
        ("/v1/completions", {"prompt": "hi", "cache_salt": 5}, {}),
        ("/v1/completions", {"prompt": "hi", "cache_salt": "x" * 2000}, {}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "cache_salt": ["a"]},
            {},
        ),  # fmt: skip
        (
            "/v1/messages",
            {"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "cache_salt": ""},
            {},
        ),  # fmt: skip
        ("/v1/completions", {"prompt": "hi"}, {HEADER: "y" * 2000}),
    ],
)
def test_a_bad_salt_is_a_400_naming_it(server, path, body, headers):
    r = httpx.post(server.url + path, json={"model": "m", **body}, headers=headers, timeout=30)
    assert r.status_code == 400, r.text
    assert "cache_salt" in r.json()["error"]["message"]
    if path != "/v1/messages":
        assert r.json()["error"]["param"] == "cache_salt"


def test_the_sdk_takes_the_salt(server):
    prompt = _prompt(3)
    with Client(server.zmq_address, timeout=60) as client:

        def cached(salt):
            out = client.generate(input_ids=prompt, max_new_tokens=1, temperature=0,
                                  cache_salt=salt)  # fmt: skip
            return out.usage.cached_tokens

        assert cached("sdk-a") == 0 and cached("sdk-b") == 0
        assert cached("sdk-a") == len(prompt) - 1
        with pytest.raises(Exception, match="cache_salt"):
            cached("z" * 5000)


def test_a_cache_control_breakpoint_outlives_newer_unmarked_prefixes(server, claude):
    """The marked system prompt is the oldest entry of a pool that newer prompts overflow:
    plain LRU would evict it first; the breakpoint keeps it, and its unmarked twin goes."""
    marked = " ".join(f"rule {i} holds" for i in range(12))
    twin = " ".join(f"fact {i} stands" for i in range(12))

    def ask(system: str, question: str, mark: bool) -> int:
        block = {"type": "text", "text": system}
        if mark:
            block["cache_control"] = {"type": "ephemeral"}
        out = claude.messages.create(
            model="m", max_tokens=1, system=[block],
            messages=[{"role": "user", "content": question}], extra_body={"temperature": 0.0},
        )  # fmt: skip
        return out.usage.cache_read_input_tokens

    ask(marked, "first question", mark=True)
    ask(twin, "first question", mark=False)
    for seed in range(4):  # newer prompts that do not fit beside both systems
        completion_cached(server, _prompt(100 + seed, 150))
    r = httpx.post(server.url + "/tokenize", json={"prompt": "<|im_start|>system\n" + marked})
    system_tokens = r.json()["count"]
    assert system_tokens > 60
    assert ask(marked, "second question", mark=True) >= system_tokens - 2
    assert ask(twin, "second question", mark=False) < 10  # evicted (but for the role header)
