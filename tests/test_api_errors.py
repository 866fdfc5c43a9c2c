"""Bad input gets a 400 with the API's own error body, never a 500: a lone UTF-16
surrogate on every endpoint that tokenizes, errors that name the request's own field
(`param` included), NaN and infinity, unknown chat roles, Anthropic's own limits; and the
context length the server reports is what one request can really have. A real server,
raw HTTP bytes (JSON may spell what a JSON library would not send)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.server import checked_server

POOL = 4096  # --max-total-tokens: smaller than the tiny model's 32,768-token context
USER = b'[{"role": "user", "content": "hi"}]'


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("api-errors") / "server.log"
    with checked_server(tiny_model, log, ["--max-total-tokens", str(POOL)]) as srv:
        yield srv


def _post(server, path: str, raw: bytes) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(server.url + path, content=raw, headers=headers, timeout=60)


SURROGATE = rb'"a\ud800b"'  # JSON's escape of a lone high surrogate
SURROGATE_CASES = [
    ("/v1/completions", b'{"prompt": %s, "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", %s], "max_tokens": 2}', "prompt[1]"),
    ("/v1/completions", b'{"prompt": "ab", "regex": %s, "max_tokens": 2}', "regex"),
    ("/v1/completions", b'{"prompt": "ab", "logit_bias": {%s: 1}}', "logit_bias"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": %s}]}',
     "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": ' + USER + b', "regex": %s}', "regex"),
    ("/v1/messages", b'{"max_tokens": 2, "messages": [{"role": "user", "content": %s}]}',
     "messages[0].content"),
    ("/v1/messages", b'{"max_tokens": 2, "messages": ' + USER + b', "regex": %s}', "regex"),
    ("/v1/messages/count_tokens", b'{"messages": [{"role": "user", "content": %s}]}',
     "messages[0].content"),
    ("/tokenize", b'{"prompt": %s}', "prompt"),
    ("/tokenize", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}]}',
     "messages[0].content[0].text"),
]  # fmt: skip


@pytest.mark.parametrize("path, template, param", SURROGATE_CASES)
def test_a_lone_surrogate_is_a_400_with_the_apis_error_body(server, path, template, param):
    r = _post(server, path, template % SURROGATE)
    assert r.status_code == 400, r.text
    message = f"{param}: a lone UTF-16 surrogate (\\ud800) is not valid Unicode text"
    if path.startswith("/v1/messages"):
        assert r.json() == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": message},
        }
    else:
        error = r.json()["error"]
        assert error == {
            "message": message,
            "type": "invalid_request_error",
            "code": "invalid_request_error",
            "param": param,
        }


def test_a_surrogate_pair_is_a_character(server):
    """Only a lone surrogate is refused: an escaped pair is one character (an emoji)."""
    r = _post(server, "/tokenize", rb'{"prompt": "a\ud83d\ude00b"}')
    assert r.status_code == 200, r.text
    again = httpx.post(server.url + "/tokenize", json={"prompt": "a\U0001f600b"}, timeout=30)
    assert r.json() == again.json()


CHAT, COMP, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/messages"
FIELD_CASES = [
    (COMP, b'{"prompt": "hi", "max_tokens": -1}', "max_tokens", "max_tokens must be >= 1"),
    (CHAT, b'{"messages": %s, "max_tokens": -1}' % USER, "max_tokens", "max_tokens must be"),
    (CHAT, b'{"messages": %s, "max_completion_tokens": 0}' % USER, "max_completion_tokens",
     "max_completion_tokens must be >= 1"),
    (COMP, b'{"prompt": "hi", "temperature": NaN}', "temperature",
     "temperature must be a finite number, not nan"),
    (COMP, b'{"prompt": "hi", "top_p": Infinity}', "top_p",
     "top_p must be a finite number, not inf"),
    (CHAT, b'{"messages": %s, "presence_penalty": -Infinity}' % USER, "presence_penalty",
     "presence_penalty must be a finite number, not -inf"),
    (COMP, b'{"prompt": "hi", "logprobs": 21}', "logprobs", "logprobs must be in [0, 20]"),
    (CHAT, b'{"messages": %s, "logprobs": true, "top_logprobs": 21}' % USER, "top_logprobs",
     "top_logprobs must be in [0, 20]"),
    (COMP, b'{"prompt": "hi", "logit_bias": {"5": 101}}', "logit_bias", "logit_bias values"),
    (CHAT, b'{"messages": [{"role": "wizard", "content": "hi"}]}', "messages[0].role",
     "messages[0].role must be one of system, developer, user, assistant, tool, function, "
     "not 'wizard'"),
    (CHAT, b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content",
     "messages[0].content must be a string"),
    (COMP, b'{"prompt": "hi", "max_tokens": "x"}', "max_tokens", "max_tokens: Input should be"),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text"}]}]}',
     "messages[0].content[0]", "a text part needs a string 'text'"),
    ("/tokenize", b'{"messages": [{"role": "wizard", "content": "hi"}]}', "messages[0].role",
     "not 'wizard'"),
]  # fmt: skip


@pytest.mark.parametrize("path, raw, param, needle", FIELD_CASES)
def test_an_error_names_the_requests_own_field(server, path, raw, param, needle):
    r = _post(server, path, raw)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["param"] == param, error
    assert "max_new_tokens" not in error["message"]


@pytest.mark.parametrize(
    "extra, status, needle",
    [
        (b'"temperature": 5', 400, "temperature: range: 0 <= temperature <= 1"),
        (b'"temperature": 1', 200, None),
        (b'"temperature": NaN', 400, "temperature must be a finite number, not nan"),
        (b'"top_p": 0', 400, "top_p must be in (0, 1]"),
    ],
)
def test_anthropic_limits_in_anthropics_error_body(server, extra, status, needle):
    raw = b'{"max_tokens": 1, "messages": %s, %s}' % (USER, extra)
    r = _post(server, MESSAGES, raw)
    assert r.status_code == status, r.text
    if needle is not None:
        assert r.json()["type"] == "error" and r.json()["error"]["message"] == needle


def test_anthropic_max_tokens_is_named_as_anthropic_names_it(server):
    r = _post(server, MESSAGES, b'{"max_tokens": 0, "messages": %s}' % USER)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "max_tokens must be >= 1"


def test_the_reported_max_model_len_is_what_one_request_can_have(server, tiny_model):
    """The pool holds fewer tokens than the model's context: the limit clients see is
    the pool's; a prompt beyond it is refused as too long for that limit, and a max_tokens
    beyond it is cut to the room the prompt leaves (finish_reason length)."""
    context = json.loads((Path(tiny_model) / "config.json").read_text())["max_position_embeddings"]
    assert context > POOL
    card = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
    assert card["max_model_len"] == POOL
    r = httpx.post(server.url + "/tokenize", json={"prompt": "hi"}, timeout=30)
    assert r.json()["max_model_len"] == POOL
    too_long = {"prompt": [5] * POOL, "max_tokens": 1}
    r = httpx.post(server.url + COMP, json=too_long, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded", error
    assert f"maximum context length is {POOL} tokens" in error["message"]
    fits = {"prompt": [5] * (POOL - 10), "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.url + COMP, json=fits, timeout=120)
    assert r.status_code == 200, r.text
    assert (r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["finish_reason"]) == (
        10,
        "length",
    )
