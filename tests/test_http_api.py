"""The OpenAI-compatible HTTP API end to end: the official `openai` client, malformed bodies
with httpx, multi-byte UTF-8 streaming, stop strings, API keys, size and context limits,
and clients that disconnect (their slots must be freed; the server runs with
--debug-invariants, so a bookkeeping error would kill its scheduler).
"""

from __future__ import annotations

import json
import random
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest

from router.api.detokenizer import REPLACEMENT, IncrementalDetokenizer
from router.api.openai_api import TokenPieces, chat_logprobs, completion_logprobs
from router.client import Client, RadixMLXError
from tests.conftest import load_model, mlx_greedy
from tests.server import ServerProcess
from tests.test_metrics import PREFIX, delta, scrape, wait_idle, wait_running

ABORTS = PREFIX + 'requests_total{finish_reason="abort"}'
STOPS = PREFIX + 'requests_total{finish_reason="stop"}'
MULTIBYTE = "日本語のテキスト、中文文本 😀🎉 Größere Städte, café déjà vu — ½ ∑ λ"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """The tiny model with --debug-invariants (KV bookkeeping checked after every step)."""
    log = tmp_path_factory.mktemp("http") / "server.log"
    srv = ServerProcess(tiny_model, log, extra=["--max-total-tokens", "8192", "--debug-invariants"])
    srv.start()
    yield srv
    alive = srv.proc.poll() is None
    srv.stop()
    assert alive, "the server died during the tests:\n" + srv.log()[-3000:]
    assert "Traceback" not in srv.log()


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_model(tiny_model)[1]


def _chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _prompt(seed: int, n: int = 20) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def _sse(response: httpx.Response) -> list[dict]:
    """Events of a server-sent stream, checking the framing and the final [DONE]."""
    raw = response.read()
    raw.decode("utf-8")  # strict: no broken character on the wire
    events = [e for e in raw.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]


# ---------------------------------------------------------------- the openai client


@pytest.mark.slow
def test_chat_completion_matches_mlx_lm(server, oai, tiny_model, tokenizer):
    messages = [{"role": "user", "content": "Name three colours."}]
    ids = _chat_ids(tokenizer, messages)
    (model,) = [m.id for m in oai.models.list().data]
    r = oai.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    choice = r.choices[0]
    expected = mlx_greedy(tiny_model, ids, 10)
    assert choice.model_extra["token_ids"] == expected
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert choice.finish_reason == "length"
    assert r.object == "chat.completion" and r.model == model
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 10
    assert r.usage.total_tokens == len(ids) + 10

    stream = oai.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 10
    assert usage.usage.prompt_tokens == len(ids)
    # Everything was cached but the last prompt token.
    assert usage.usage.prompt_tokens_details.cached_tokens == len(ids) - 1
    assert all(c.usage is None for c in chunks[:-1])


_IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def _user(content) -> dict:
    return {"role": "user", "content": content}


def _choices_of_stream(response) -> tuple[dict[int, list], dict[int, str], dict]:
    """Per choice index the token ids (completions) or text pieces (chat) and the finish
    reason, and the usage, of an SSE stream."""
    got, finish, usage = {}, {}, None
    for line in response.iter_lines():
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        event = json.loads(line[5:])
        usage = event.get("usage") or usage
        for c in event["choices"]:
            if "delta" in c:
                if c["delta"].get("role"):
                    assert c["index"] not in got  # a choice's first chunk names the role
                got.setdefault(c["index"], []).append(c["delta"]["content"])
            else:
                got.setdefault(c["index"], []).extend(c["token_ids"])
            if c["finish_reason"]:
                finish[c["index"]] = c["finish_reason"]
    return got, finish, usage


def test_n_and_prompt_batches_make_one_choice_each(server, tiny_model):
    """n samples of a prompt and a batch of prompts: each choice is its own generation,
    greedy ones exact, seeded ones reproducible (sample j uses seed + j), usage counting
    each prompt once and every completion."""
    url = server.url + "/v1/completions"
    a, b = [5, 17, 99, 230], [300, 12, 7]
    greedy = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url, json=greedy | {"prompt": [a, b], "n": 2}, timeout=60).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    want = [mlx_greedy(tiny_model, p, 5) for p in (a, a, b, b)]
    assert [c["token_ids"] for c in r["choices"]] == want
    assert r["usage"]["prompt_tokens"] == len(a) + len(b)
    assert r["usage"]["completion_tokens"] == 20

    body = greedy | {"prompt": [a, b], "n": 2, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", url, json=body, timeout=60) as resp:
        ids, finish, usage = _choices_of_stream(resp)
    assert [ids[i] for i in range(4)] == want and set(finish.values()) == {"length"}
    assert usage["prompt_tokens"] == len(a) + len(b) and usage["completion_tokens"] == 20

    sampled = {"prompt": a, "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    three = httpx.post(url, json=sampled | {"n": 3, "seed": 10}, timeout=60).json()
    for j, c in enumerate(three["choices"]):
        alone = httpx.post(url, json=sampled | {"seed": 10 + j}, timeout=60).json()
        assert c["token_ids"] == alone["choices"][0]["token_ids"]
    assert len({tuple(c["token_ids"]) for c in three["choices"]}) > 1


def test_chat_n_streams_each_choice_with_its_role(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 3}
    body |= {"temperature": 0, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as resp:
        texts, finish, usage = _choices_of_stream(resp)
    assert sorted(texts) == [0, 1, 2]
    assert "".join(texts[0]) == "".join(texts[1]) == "".join(texts[2])  # greedy
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert usage["completion_tokens"] == 12


def test_logit_bias_bans_and_favours_tokens(server):
    body = {"prompt": [5, 17, 99, 230], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    url = server.url + "/v1/completions"
    plain = httpx.post(url, json=body, timeout=30).json()["choices"][0]["token_ids"]
    banned = {str(t): -100 for t in plain}
    biased = httpx.post(url, json=body | {"logit_bias": banned}, timeout=30).json()
    assert not set(plain) & set(biased["choices"][0]["token_ids"])
    favoured = httpx.post(url, json=body | {"logit_bias": {"300": 100}}, timeout=30).json()
    assert favoured["choices"][0]["token_ids"] == [300] * 6


def test_chat_content_parts_and_empty_content_read_as_text(server, tokenizer):
    """OpenAI clients may send content as a list of text parts, and an assistant turn
    that only called tools has no content: both reach the template as plain strings."""
    parts = [{"type": "text", "text": "Name three"}, {"type": "text", "text": " colours."}]
    history = [_user("hi"), {"role": "assistant", "content": None}]
    plain = _user("Name three colours.")
    asked = [[plain], [_user(parts)], history + [_user(parts)]]
    empty_turn = {"role": "assistant", "content": ""}
    expected_prompts = [
        _chat_ids(tokenizer, [plain]),
        _chat_ids(tokenizer, [plain]),
        _chat_ids(tokenizer, [_user("hi"), empty_turn, plain]),
    ]
    outputs = []
    for messages, prompt in zip(asked, expected_prompts):
        body = {"messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(prompt)
        outputs.append(r.json()["choices"][0]["token_ids"])
    assert outputs[0] == outputs[1]


@pytest.mark.slow
def test_completions_text_and_token_prompts(server, oai, tiny_model, tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = mlx_greedy(tiny_model, ids, 8)
    by_text = oai.completions.create(
        model="", prompt=text, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    # temperature 1 with top_k 1 is greedy too; both non-standard fields via extra_body.
    by_ids = oai.completions.create(
        model="", prompt=ids, max_tokens=8, extra_body={"ignore_eos": True, "top_k": 1}
    )
    for r in (by_text, by_ids):
        assert r.choices[0].model_extra["token_ids"] == expected
        assert r.choices[0].text == tokenizer.decode(expected)
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 8
    echo = oai.completions.create(model="", prompt=ids, max_tokens=2, temperature=0, echo=True)
    assert echo.choices[0].text.startswith(text)

    stream = oai.completions.create(
        model="",
        prompt=ids,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    streamed = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert streamed == expected
    assert "".join(c.choices[0].text for c in chunks if c.choices) == by_text.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8


@pytest.mark.slow
def test_cached_tokens_grow_on_a_repeated_prompt(server, oai):
    prompt = _prompt(11, 48)
    first = oai.completions.create(model="", prompt=prompt, max_tokens=2, temperature=0)
    second = oai.completions.create(model="", prompt=prompt, max_tokens=2, temperature=0)
    longer = oai.completions.create(model="", prompt=prompt + [7, 8, 9], max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1
    assert longer.usage.prompt_tokens_details.cached_tokens >= len(prompt)
    assert second.choices[0].model_extra["token_ids"] == first.choices[0].model_extra["token_ids"]


@pytest.mark.slow
def test_errors_surface_as_openai_exceptions(server, oai):
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        (openai.NotFoundError, "does not exist", dict(model="gpt-4")),
        (openai.BadRequestError, "1 to 64 choices (prompts x n), not 65", dict(n=65)),
        (openai.BadRequestError, "must be a function tool", dict(tools=[{"type": "x"}])),
        (
            openai.BadRequestError,
            "response_format.type must be",
            dict(response_format={"type": "yaml"}),
        ),
        (openai.BadRequestError, "temperature must be >= 0", dict(temperature=-1)),
        (openai.BadRequestError, "top_p must be in (0, 1]", dict(top_p=1.5)),
        (
            openai.BadRequestError,
            "maximum context length is 8192",
            dict(messages=[{"role": "user", "content": "hi " * 8192}]),
        ),
    ]
    for exc, needle, kwargs in cases:
        with pytest.raises(exc) as info:
            oai.chat.completions.create(**({"model": "", "messages": msgs} | kwargs))
        assert needle in info.value.message, (kwargs, info.value.message)
        assert info.value.body["message"] == info.value.message.split(" - ", 1)[-1]
    with pytest.raises(openai.BadRequestError, match="prompt token ids must be in"):
        oai.completions.create(model="", prompt=[1, 2, 100000], max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="context_length_exceeded|context length"):
        oai.completions.create(model="", prompt=[5] * 8192, max_tokens=1)


# ---------------------------------------------------------------- malformed bodies (httpx)


@pytest.mark.slow
def test_malformed_bodies_get_openai_errors(server):
    comp, chat = "/v1/completions", "/v1/chat/completions"
    hi = [{"role": "user", "content": "hi"}]
    cases = [
        (comp, b"{not json", 400, "malformed JSON"),
        (comp, b"", 400, "the request has no body"),
        (comp, b"[1, 2]", 400, "invalid request"),
        (comp, {"max_tokens": 2}, 400, "prompt: Field required"),
        (comp, {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        (comp, {"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
        (comp, {"prompt": "hi", "temperature": "0.5"}, 400, "temperature"),
        (comp, {"prompt": "hi", "temperature": True}, 400, "temperature"),
        (comp, {"prompt": "hi", "stream": 1}, 400, "stream"),
        (comp, {"prompt": "hi", "stop": 5}, 400, "stop"),
        (comp, {"prompt": [[1, 2], ["a"]]}, 400, "prompt"),
        (comp, {"prompt": [[1, 2], []]}, 400, "the prompt is empty"),
        (comp, {"prompt": ["a"] * 33, "n": 2}, 400, "1 to 64 choices (prompts x n), not 66"),
        (comp, {"prompt": []}, 400, "the prompt is empty"),
        (comp, {"prompt": ""}, 400, "the prompt is empty"),
        (comp, {"prompt": [1, -2]}, 400, "prompt token ids must be in [0, 512)"),
        (comp, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens 0 needs echo"),
        (comp, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens must be >= 1"),
        (comp, {"prompt": "hi", "temperature": -0.5}, 400, "temperature must be >= 0"),
        (comp, {"prompt": "hi", "top_p": 0}, 400, "top_p must be in (0, 1]"),
        (comp, {"prompt": "hi", "top_k": -2}, 400, "top_k must be >= 1, or 0 or -1 for off"),
        (comp, {"prompt": "hi", "min_p": 2}, 400, "min_p must be in [0, 1]"),
        (comp, {"prompt": "hi", "frequency_penalty": 3}, 400, "frequency_penalty"),
        (comp, {"prompt": "hi", "presence_penalty": -3}, 400, "presence_penalty"),
        (comp, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
        (comp, {"prompt": "hi", "seed": -1}, 400, "seed must be in"),
        (comp, {"prompt": "hi", "stop_token_ids": [600]}, 400, "stop_token_ids must be in"),
        # a prompt that leaves no room in the 8192-token KV pool: the limit /v1/models
        # reports, streaming or not (a max_tokens beyond it is cut to fit)
        (comp, {"prompt": [5] * 8192, "max_tokens": 1}, 400, "maximum context length is 8192"),
        (comp, {"prompt": [5] * 8192, "stream": True}, 400, "is 8192 tokens"),
        (comp, {"prompt": "hi", "model": "no-such-model"}, 404, "does not exist"),
        (comp, {"prompt": "hi", "n": 0}, 400, "1 to 64 choices (prompts x n), not 0"),
        (chat, {"messages": []}, 400, "messages"),
        (chat, {"messages": "hi"}, 400, "messages"),
        (chat, {"messages": hi, "max_completion_tokens": "x"}, 400, "max_completion_tokens"),
        (chat, {"messages": hi, "tools": [{"type": "x"}]}, 400, "must be a function tool"),
        (chat, {"messages": hi, "response_format": {"type": "json_schema"}}, 400, "'schema'"),
        (chat, {"messages": hi, "n": -1}, 400, "choices (prompts x n)"),
        (chat, {"messages": hi, "top_logprobs": 2}, 400, "top_logprobs needs logprobs"),
        (chat, {"messages": hi, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        (comp, {"prompt": "hi", "logprobs": 21}, 400, "logprobs must be in [0, 20]"),
        (chat, {"messages": hi, "model": "other"}, 404, "does not exist"),
        (comp, {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias keys must be token"),
        (comp, {"prompt": "hi", "logit_bias": {"512": 1}}, 400, "token ids in [0, 512)"),
        (comp, {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias values must be in"),
        (comp, {"prompt": "hi", "logit_bias": {"5": "x"}}, 400, "logit_bias"),
        (chat, {"messages": [{"content": "hi"}]}, 400, "with a string 'role'"),
        (chat, {"messages": [{"role": "user", "content": 5}]}, 400, "a list of text parts"),
        (chat, {"messages": [_user([{"type": "text"}])]}, 400, "needs a string 'text'"),
        (chat, {"messages": [_user([_IMAGE])]}, 400, "only text content parts are supported"),
    ]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path, body, status, needle in cases:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = http.post(path, content=content, headers={"content-type": "application/json"})
            assert r.status_code == status, (body, r.status_code, r.text)
            err = r.json()["error"]
            assert needle in err["message"], (body, err)
            assert {"message", "type", "code"} <= set(err)
            assert err["type"] == "invalid_request_error"
        assert http.get("/no/such/path").json()["error"]["code"] == "not_found"
        assert http.get(comp).status_code == 405
        # null means "the default", as in OpenAI's API
        nulls = {"prompt": [5, 6], "max_tokens": 2, "temperature": None, "top_p": None, "n": None}
        assert http.post(comp, json=nulls | {"stop": None, "seed": None}).status_code == 200
        # and the server still serves
        r = http.post(comp, json={"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_chat_without_max_tokens_fits_the_kv_pool(server):
    """The default completion budget is what fits in the context AND the 8192-token pool."""
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    body["stop_token_ids"] = list(range(3, 512))  # any token ends it at once
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


@pytest.mark.slow
def test_api_key_body_limit_and_context_length(tiny_model, tmp_path):
    srv = ServerProcess(
        tiny_model,
        tmp_path / "log",
        extra=[
            "--max-total-tokens", "512", "--context-length", "64",
            "--api-key", "sesame", "--max-request-bytes", "4096",
            "--allowed-origins", "http://ui.local",
        ],
    )  # fmt: skip
    srv.start()
    try:
        good = {"authorization": "Bearer sesame"}
        body = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            assert http.get("/health").status_code == 200  # open
            assert http.get("/metrics").status_code == 200  # open
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "sesame"}):
                for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
                    r = http.request(method, path, json=body, headers=headers)
                    assert r.status_code == 401, (headers, path)
                    assert r.json()["error"]["code"] == "invalid_api_key"
            assert http.get("/v1/models", headers=good).status_code == 200
            assert http.post("/v1/completions", json=body, headers=good).status_code == 200
            assert http.post("/tokenize", json={"prompt": "a"}).status_code == 401
            assert http.post("/tokenize", json={"prompt": "a"}, headers=good).status_code == 200

            # CORS for the allowed origin only; its preflight needs no API key
            for origin, allowed in (("http://ui.local", True), ("http://elsewhere", False)):
                ask = {"origin": origin, "access-control-request-method": "POST"}
                pre = http.options("/v1/completions", headers=ask)
                assert (pre.status_code == 200) is allowed, pre.text
                r = http.post("/v1/completions", json=body, headers=good | {"origin": origin})
                assert r.status_code == 200
                assert (r.headers.get("access-control-allow-origin") == origin) is allowed

            # Over --max-request-bytes: by Content-Length, and counted on a chunked upload.
            big = {"prompt": "x" * 5000, "max_tokens": 1}
            r = http.post("/v1/completions", json=big, headers=good)
            assert r.status_code == 413 and "exceeds the limit of 4096" in r.text
            chunks = (json.dumps(big).encode()[i : i + 1000] for i in range(0, 6000, 1000))
            r = http.post("/v1/completions", content=chunks, headers=good)
            assert r.status_code == 413, r.text
            assert r.json()["error"]["code"] == "request_too_large"

            # Longer than --context-length 64.
            too_long = {"prompt": list(range(3, 73)), "max_tokens": 1}
            r = http.post("/v1/completions", json=too_long, headers=good)
            assert r.status_code == 400
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded"
            assert "maximum context length is 64 tokens" in err["message"]
            # A prompt that fits with a max_tokens that does not: cut to the 4 tokens left.
            fits_prompt = {"prompt": list(range(3, 63)), "max_tokens": 10, "ignore_eos": True}
            r = http.post("/v1/completions", json=fits_prompt, headers=good)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
            assert r.json()["choices"][0]["finish_reason"] == "length"
            assert http.get("/v1/models", headers=good).json()["data"][0]["max_model_len"] == 64

        with openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="sesame", max_retries=0) as ok:
            r = ok.completions.create(model="", prompt=[5, 6], max_tokens=2, temperature=0)
            assert r.choices[0].finish_reason == "length"

        # The SDK front door asks for the same key.
        for key in (None, "wrong"):
            with Client(srv.zmq_address, timeout=30, api_key=key) as sdk:
                with pytest.raises(RadixMLXError, match="API key") as err:
                    sdk.generate(input_ids=[5, 6], max_new_tokens=2)
                assert err.value.status == 401
        with Client(srv.zmq_address, timeout=30, api_key="sesame") as sdk:
            assert sdk.generate(input_ids=[5, 6], max_new_tokens=2).finish_reason == "length"
    finally:
        srv.stop()


# ---------------------------------------------------------------- multi-byte UTF-8


def test_incremental_detokenizer_on_multibyte_text(tiny_model):
    _, tokenizer = load_model(tiny_model)
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert sum(REPLACEMENT in p for p in pieces) >= 10  # characters really are split
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([i]) for i in ids]
    assert detok.flush() == ""
    assert "".join(deltas) == MULTIBYTE
    assert not any(REPLACEMENT in d for d in deltas)
    assert "" in deltas  # held back while a character was incomplete
    # Every emitted prefix is a prefix of the text: no character is ever cut.
    text = ""
    for d in deltas:
        text += d
        assert MULTIBYTE.startswith(text)
    # Random token sequences (often invalid UTF-8): the deltas add up to the full decode
    # and only a final flush may end in U+FFFD.
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(0, len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(tokenizer)
        deltas, i = [], 0
        while i < len(ids):
            step = rng.randrange(1, 4)
            deltas.append(detok.add(ids[i : i + step]))
            i += step
        assert not any(d.endswith(REPLACEMENT) for d in deltas)
        whole = "".join(deltas) + detok.flush()
        assert whole == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_streaming_never_breaks_a_character(server, tokenizer):
    prompts = [MULTIBYTE, "中文文本很好", "Emoji 😀🎉 party", "Größere Städte", _prompt(3)]
    saw_multibyte = saw_split = False
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for i, prompt in enumerate(prompts):
            if i == 0:  # one through chat
                path = "/v1/chat/completions"
                body = {"messages": [{"role": "user", "content": prompt}]}
            else:
                path, body = "/v1/completions", {"prompt": prompt}
            body |= {"max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True}
            with http.stream("POST", path, json=body) as r:
                assert r.status_code == 200
                events = _sse(r)
            choices = [e["choices"][0] for e in events]
            if i == 0:
                deltas = [c["delta"]["content"] for c in choices]
                r = httpx.post(server.url + path, json=body | {"stream": False}, timeout=60)
                out_ids = r.json()["choices"][0]["token_ids"]
            else:
                deltas = [c["text"] for c in choices]
                out_ids = [t for c in choices for t in c["token_ids"]]
            assert len(out_ids) == 48
            for d in deltas:
                d.encode("utf-8")  # no lone surrogate
            assert not any(d.endswith(REPLACEMENT) for d in deltas[:-1]), deltas
            assert "".join(deltas) == tokenizer.decode(out_ids, skip_special_tokens=True)
            assert all(d or c["finish_reason"] for d, c in zip(deltas[1:], choices[1:]))
            text = "".join(deltas)
            saw_multibyte |= any(ord(ch) > 127 and ch != REPLACEMENT for ch in text)
            saw_split |= any(REPLACEMENT in tokenizer.decode([t]) for t in out_ids)
    assert saw_multibyte and saw_split


# ---------------------------------------------------------------- stop strings


def _pick_stop(text: str) -> tuple[str, int]:
    """A 3-character stop string from the middle of `text` (no U+FFFD), and where it first
    occurs."""
    for k in range(6, len(text) // 2):
        s = text[k : k + 3]
        if REPLACEMENT not in s and text.find(s) == k and len(s) == 3:
            return s, k
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.slow
def test_stop_strings_cut_the_text_and_abort_upstream(server, oai):
    prompt = _prompt(5)
    full = oai.completions.create(
        model="", prompt=prompt, max_tokens=64, temperature=0, extra_body={"ignore_eos": True}
    )
    text = full.choices[0].text
    stop, k = _pick_stop(text)
    before = scrape(server.url)
    log_lines = server.log().count("Decode batch")
    r = oai.completions.create(
        model="",
        prompt=prompt,
        max_tokens=3000,
        temperature=0,
        stop=["never-there", stop],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == text[:k]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 64
    chunks = list(
        oai.completions.create(
            model="",
            prompt=prompt,
            max_tokens=3000,
            temperature=0,
            stop=stop,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == text[:k]
    assert chunks[-1].choices[0].finish_reason == "stop"
    after = wait_idle(server.url)
    assert delta(after, before, STOPS) == 2
    # Aborted upstream: 3000 tokens would log ~75 "Decode batch" lines.
    assert server.log().count("Decode batch") - log_lines < 20


# ---------------------------------------------------------------- disconnects


def _long(prompt, stream: bool) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": 4000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


@pytest.mark.slow
def test_client_disconnects_free_the_slots(server, oai):
    url = server.url
    wait_idle(url)
    before = scrape(url)
    log_lines = server.log().count("Decode batch")

    # 1. An httpx stream of three choices closed after a few chunks.
    three = _long(_prompt(21), True) | {"n": 3}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", url + "/v1/completions", json=three) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
            wait_running(url)
    wait_idle(url)

    # 2. The openai client's stream closed early.
    stream = oai.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "tell me a long story"}],
        max_tokens=4000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 5:
            break
    wait_running(url)
    stream.close()
    wait_idle(url)

    # 3. A non-streaming request of two choices whose client goes away while they run.
    body = json.dumps(_long(_prompt(22), False) | {"n": 2}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    wait_running(url)
    sock.close()
    after = wait_idle(url)

    assert delta(after, before, ABORTS) == 3 + 1 + 2
    # Six 4000-token requests run to the end would log ~600 "Decode batch" lines.
    assert server.log().count("Decode batch") - log_lines < 100
    # The scheduler (checking its invariants every step) still serves, token-exact.
    r = httpx.post(url + "/v1/completions", json={"prompt": [4, 5, 6], "max_tokens": 4})
    assert r.status_code == 200
    assert server.proc.poll() is None


@pytest.mark.slow
def test_browsers_may_call_the_api_by_default(server):
    """CORS for any origin by default, as vLLM, SGLang and mlx_lm.server allow."""
    ask = {"origin": "http://localhost:8080", "access-control-request-method": "POST"}
    ask["access-control-request-headers"] = "content-type"
    pre = httpx.options(server.url + "/v1/chat/completions", headers=ask)
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
    body = {"prompt": [5, 6], "max_tokens": 2, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=ask) as r:
        assert r.headers["access-control-allow-origin"] == "*"
        assert r.read().endswith(b"data: [DONE]\n\n")


def test_tokenize_and_detokenize_as_the_endpoints_do(server, tokenizer):
    """vLLM's /tokenize and /detokenize: the ids the completion endpoints would compute."""
    text = "Bonjour, ça va ? 日本語"
    messages = [{"role": "user", "content": text}]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post("/tokenize", json={"prompt": text}).json()
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert r == {"count": len(ids), "max_model_len": 8192, "tokens": ids}  # the pool
        chat = http.post("/tokenize", json={"messages": messages}).json()
        assert chat["tokens"] == _chat_ids(tokenizer, messages)
        completion = {"prompt": text, "max_tokens": 1}
        used = http.post("/v1/completions", json=completion).json()["usage"]["prompt_tokens"]
        assert used == len(ids)
        assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": text}
        for path, body, needle in (
            ("/tokenize", {}, "exactly one of prompt or messages"),
            ("/tokenize", {"prompt": "a", "messages": messages}, "exactly one"),
            ("/tokenize", {"messages": [{"role": "user", "content": 3}]}, "list of text parts"),
            ("/detokenize", {"tokens": [1, 512]}, "token ids must be in [0, 512)"),
            ("/detokenize", {"tokens": "abc"}, "tokens"),
        ):
            r = http.post(path, json=body)
            assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_health_and_models(server):
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok"
    assert [(r["id"], r["state"]) for r in health["replicas"]] == [("r0", "ready")]
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    # the default served name is the model directory's name, not its path
    assert card["id"] == Path(server.model).name and card["max_model_len"] == 8192  # the pool
    by_path = {"model": server.model, "prompt": "hi", "max_tokens": 1}
    assert httpx.post(server.url + "/v1/completions", json=by_path).json()["model"] == card["id"]
    t0 = time.monotonic()
    for _ in range(20):
        assert httpx.get(server.url + "/health").status_code == 200
    assert time.monotonic() - t0 < 5


# ---------------------------------------------------------------- logprobs


def test_logprob_rendering_in_openai_formats(tiny_model):
    _, tokenizer = load_model(tiny_model)
    pieces = TokenPieces(tokenizer)
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    # Byte-level tokens map back to their exact bytes, even half a character.
    assert b"".join(bytes(pieces(t)[1]) for t in ids) == MULTIBYTE.encode()
    assert any(pieces(t)[0] == REPLACEMENT for t in ids)
    assert pieces(tokenizer.encode("hello", add_special_tokens=False)[0])[0] in "hello"
    tokens = tokenizer.encode(" café", add_special_tokens=False)
    lps = [-0.5 * (i + 1) for i in range(len(tokens))]
    tops = [[[t, lp], [5, -9.0]] for t, lp in zip(tokens, lps)]

    chat = chat_logprobs(tokens, lps, tops, pieces)
    assert [e["logprob"] for e in chat["content"]] == lps
    assert "".join(e["token"] for e in chat["content"]) == " café"
    for e, t in zip(chat["content"], tokens):
        assert e["bytes"] == pieces(t)[1]
        assert [x["logprob"] for x in e["top_logprobs"]] == [e["logprob"], -9.0]
        assert set(e["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    assert chat_logprobs(tokens, None, None, pieces) is None

    comp = completion_logprobs(tokens, lps, tops, pieces, offset=3)
    assert "".join(comp["tokens"]) == " café"
    assert comp["token_logprobs"] == lps
    assert comp["text_offset"][0] == 3
    assert comp["top_logprobs"][0] == {comp["tokens"][0]: lps[0], pieces(5)[0]: -9.0}
    json.dumps(chat), json.dumps(comp)


@pytest.mark.slow
def test_logprobs_end_to_end(server, oai):
    r = oai.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)  # greedy: the best
    c = oai.completions.create(model="", prompt=[5, 6, 7], max_tokens=3, temperature=0, logprobs=2)
    assert len(c.choices[0].logprobs.token_logprobs) == 3
    assert all(len(t) <= 2 for t in c.choices[0].logprobs.top_logprobs)
