"""What agents' clients send that a small local model must still take, against a real
server on the agent model with a short context (--context-length 192), through the
official `openai` and `anthropic` SDKs and raw HTTP:

- a max_tokens beyond the context (Claude Code sends 32000) is cut to what the context
  leaves, and the answer says `length` / `max_tokens` when it gets there; a prompt that
  leaves no room is still a 400, and --strict-max-tokens restores the 400 for the rest;
- model names: several served names (the first reported), alias globs for other names
  (`claude-haiku-*` side calls), a 404 for any other, `GET /v1/models/{id}`;
- one access-log line per HTTP request, and `HEAD /`, `HEAD /health`.
"""

from __future__ import annotations

import re

import anthropic
import httpx
import openai
import pytest

from tests.server import ServerProcess, checked_server, log_lines

CONTEXT = 192
SERVER = [
    "--max-total-tokens", "8192", "--context-length", str(CONTEXT),
    "--served-model-name", "m", "--served-model-name", "second",
    "--model-alias", "claude-haiku-*", "--model-alias", "gpt-?",
]  # fmt: skip
LONG = "[a-z]{1000}"  # a regex no answer within the context completes: it runs to the end
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(agent_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("agents") / "server.log"
    with checked_server(agent_model, log, SERVER) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key="-", max_retries=0) as client:
        yield client


def test_max_tokens_beyond_the_context_is_cut_to_fit(oai, claude, server):
    out = oai.chat.completions.create(
        model="m", messages=ASK, max_tokens=32000, temperature=0, extra_body={"regex": LONG}
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens + out.usage.completion_tokens == CONTEXT
    # (the SDK refuses a non-streaming request this large without an explicit timeout)
    msg = claude.messages.create(
        model="m", max_tokens=32000, messages=ASK, extra_body={"regex": LONG, "temperature": 0.0},
        timeout=60,
    )  # fmt: skip
    assert msg.stop_reason == "max_tokens"
    usage = msg.usage
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.output_tokens == CONTEXT
    with claude.messages.stream(model="m", max_tokens=32000, messages=ASK,
                                extra_body={"regex": LONG}) as stream:  # fmt: skip
        assert stream.get_final_message().stop_reason == "max_tokens"
    # a prompt that leaves room for one token gets it; one that leaves none is refused
    fits = oai.completions.create(model="m", prompt=[5] * (CONTEXT - 1), max_tokens=4000)
    assert fits.choices[0].finish_reason == "length" and fits.usage.completion_tokens == 1
    with pytest.raises(openai.BadRequestError, match="maximum context length is 192") as err:
        oai.completions.create(model="m", prompt=[5] * CONTEXT, max_tokens=1)
    assert err.value.code == "context_length_exceeded"
    long_chat = [{"role": "user", "content": "word " * CONTEXT}]
    with pytest.raises(anthropic.BadRequestError, match="maximum context length"):
        claude.messages.create(model="m", max_tokens=10, messages=long_chat)
    # within the context, max_tokens is what it was
    short = oai.completions.create(model="m", prompt="hi", max_tokens=3, extra_body={"regex": LONG})
    assert short.usage.completion_tokens == 3


def test_a_thought_leaves_room_for_the_answer_within_the_cut(claude):
    """Thinking with max_tokens 32000 on a 192-token context: the thought is bounded by
    half of what the context leaves, so the answer still has room."""
    thinking = {"type": "enabled", "budget_tokens": 31999}  # Claude Code's, with 32000
    msg = claude.messages.create(
        model="m", max_tokens=32000, messages=ASK, thinking=thinking,
        extra_body={"temperature": 0.0}, timeout=60,
    )  # fmt: skip
    assert msg.content[0].type == "thinking"
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert text.strip()  # the thought did not run to the end of the context


def test_strict_max_tokens_refuses_what_does_not_fit(tiny_model, tmp_path):
    srv = ServerProcess(tiny_model, tmp_path / "server.log",
                        ["--context-length", "64", "--strict-max-tokens"])  # fmt: skip
    srv.start()
    try:
        body = {"messages": ASK, "max_tokens": 32000}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"
        r = httpx.post(srv.url + "/v1/messages", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["type"] == "error"
        assert "maximum context length is 64" in r.json()["error"]["message"]
        ok = httpx.post(srv.url + "/v1/chat/completions", json=body | {"max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2
    finally:
        srv.stop()


def test_model_names_and_aliases(oai, claude, server):
    assert [m.id for m in oai.models.list().data] == ["m", "second"]
    assert oai.models.retrieve("second").id == "second"
    assert oai.models.retrieve("claude-haiku-4-5").max_model_len == CONTEXT
    missing = httpx.get(server.url + "/v1/models/claude-opus-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    for name in ("second", "gpt-4", "claude-haiku-4-5-20251001"):
        out = oai.chat.completions.create(model=name, messages=ASK, max_tokens=2)
        assert out.model == "m"  # the reported name
    side = claude.messages.create(model="claude-haiku-4-5", max_tokens=2, messages=ASK)
    assert side.model == "m"
    with pytest.raises(openai.NotFoundError) as err:
        oai.chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=2)
    assert err.value.code == "model_not_found" and "gpt-4o" in err.value.message
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="claude-opus-4", max_tokens=2, messages=ASK)
    assert err.value.body["error"]["type"] == "not_found_error"


def test_one_access_log_line_per_request(oai, server):
    out = oai.chat.completions.create(model="m", messages=ASK, max_tokens=3, temperature=0)
    usage = out.usage
    (line,) = log_lines(server, r"POST /v1/chat/completions 200, .*#generated-token: 3$")
    assert re.search(
        r"\[.* router\] POST /v1/chat/completions 200, latency: \d+\.\d{3} s, "
        rf"#prompt-token: {usage.prompt_tokens}, "
        rf"#cached-token: {usage.prompt_tokens_details.cached_tokens}, ",
        line,
    )
    stream = oai.completions.create(model="m", prompt="hi there", max_tokens=5, stream=True,
                                    extra_body={"regex": LONG})  # fmt: skip
    assert len(list(stream)) >= 5
    assert log_lines(server, r"POST /v1/completions 200, .*#generated-token: 5$")
    # refused before any generation: the status and the error's message
    httpx.post(server.url + "/v1/chat/completions", json={"model": "nope", "messages": ASK})
    assert log_lines(server, r"POST /v1/chat/completions 404, latency: .* s, "
                             r"error: model 'nope' does not exist")  # fmt: skip
    json_type = {"content-type": "application/json"}
    httpx.post(server.url + "/v1/messages", content=b"{not json", headers=json_type)
    assert log_lines(server, r"POST /v1/messages 400, .*error: malformed JSON body")
    httpx.get(server.url + "/v1/nothing-here")
    assert log_lines(server, r"GET /v1/nothing-here 404, .*error: Not Found")


def test_head_requests(server):
    for path in ("/", "/health"):
        r = httpx.head(server.url + path)
        assert r.status_code == 200 and r.content == b""
        assert log_lines(server, rf"HEAD {path} 200, latency")
    assert httpx.get(server.url + "/").status_code == 200
