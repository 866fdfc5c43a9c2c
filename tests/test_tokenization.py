"""Prompts reach the model tokenized exactly as mlx_lm.server tokenizes them.

Through a real server, on a model whose tokenizer adds a BOS (as Llama 3's and Gemma's
do) and on the default one that adds none. The reference is mlx-lm's own tokenizer
wrapper called the way its server calls it: ``encode(prompt)`` for a completion's text,
``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` for a chat.
"""

from __future__ import annotations

import httpx
import pytest

from router.client import Client
from tests.conftest import load_model, mlx_greedy

pytestmark = pytest.mark.slow

TEXT = "The quick brown fox jumps over the lazy dog."
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour of the sea."},
]
GREEDY = {"temperature": 0, "ignore_eos": True}


def mlx_server_text_ids(model: str, text: str) -> list[int]:
    return load_model(model)[1].encode(text)


def mlx_server_chat_ids(model: str, messages: list[dict]) -> list[int]:
    wrapper = load_model(model)[1]
    return wrapper.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


def bos_count(model: str, ids: list[int]) -> int:
    bos = load_model(model)[1].bos_token_id
    return 0 if bos is None else ids.count(bos)


def has_bos(model: str) -> int:
    return int(load_model(model)[1].bos_token_id is not None)


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_text_prompt_is_encoded_with_the_tokenizers_special_tokens(parity_server):
    server, model = parity_server
    ref = mlx_server_text_ids(model, TEXT)
    assert bos_count(model, ref) == has_bos(model)
    assert post(server, "/tokenize", {"prompt": TEXT})["tokens"] == ref
    res = post(server, "/v1/completions", {"prompt": TEXT, "max_tokens": 8, **GREEDY})
    assert res["usage"]["prompt_tokens"] == len(ref)
    assert res["choices"][0]["token_ids"] == mlx_greedy(model, ref, 8)


def test_chat_prompt_has_the_templates_bos_only(parity_server):
    server, model = parity_server
    ref = mlx_server_chat_ids(model, MESSAGES)
    assert bos_count(model, ref) == has_bos(model)
    assert post(server, "/tokenize", {"messages": MESSAGES})["tokens"] == ref
    body = {"messages": MESSAGES, "max_tokens": 8, **GREEDY}
    res = post(server, "/v1/chat/completions", body)
    assert res["usage"]["prompt_tokens"] == len(ref)
    assert res["choices"][0]["token_ids"] == mlx_greedy(model, ref, 8)


def test_token_id_prompt_is_computed_as_given(parity_server):
    """Token ids are the caller's exact prompt: nothing is added, not even a BOS."""
    server, model = parity_server
    ids = load_model(model)[1].encode(TEXT, add_special_tokens=False)
    res = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 8, **GREEDY})
    assert res["usage"]["prompt_tokens"] == len(ids)
    assert res["choices"][0]["token_ids"] == mlx_greedy(model, ids, 8)


def test_sdk_text_and_chat_are_encoded_as_over_http(parity_server):
    server, model = parity_server
    with Client(server.zmq_address, timeout=60) as client:
        text = client.generate(TEXT, max_new_tokens=6, **GREEDY)
        chat = client.chat(MESSAGES, max_new_tokens=6, **GREEDY)
    for result, ref in [
        (text, mlx_server_text_ids(model, TEXT)),
        (chat, mlx_server_chat_ids(model, MESSAGES)),
    ]:
        assert result.usage.prompt_tokens == len(ref)
        assert result.output_ids == mlx_greedy(model, ref, 6)


def test_anthropic_messages_are_encoded_as_a_chat(parity_server):
    """The Messages API renders through the same template: one BOS, the same prompt."""
    server, model = parity_server
    ref = mlx_server_chat_ids(model, MESSAGES)
    body = {"system": MESSAGES[0]["content"], "messages": MESSAGES[1:]}
    assert post(server, "/v1/messages/count_tokens", body)["input_tokens"] == len(ref)
    usage = post(server, "/v1/messages", {**body, "max_tokens": 4, "temperature": 0})["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(ref)
