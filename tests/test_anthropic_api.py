"""The Anthropic Messages API through the official `anthropic` SDK against a real server on
the agent model (thinking and tool-call tokens; tests/agent_model.py), run with --api-key:
the SDK sends `x-api-key`, the OpenAI SDK `Authorization: Bearer`, and both get in. The
random-weight model's output is forced by grammars where its content matters."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.conftest import load_model
from tests.server import checked_server, log_lines
from tests.test_tools_api import AGENT_SERVER, UNICODE_ARGS, WEATHER

KEY = "sekret"
TOOLS = [
    {"name": "get_weather", "description": "forecast", "input_schema": WEATHER},
    {
        "name": "search",
        "input_schema": {
            "type": "object",
            "properties": {"query": {"const": UNICODE_ARGS["query"]}},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
]
SYSTEM = [{"type": "text", "text": "You are a helpful agent."}]
ASK = [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}]


@pytest.fixture(scope="module")
def server(agent_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("anthropic") / "server.log"
    with checked_server(agent_model, log, [*AGENT_SERVER, "--api-key", KEY]) as srv:
        yield srv


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0) as client:
        yield client


def create(claude, **kw):
    """messages.create; this SDK has no sampling arguments (temperature, top_p, top_k):
    they go in the body as the API takes them."""
    kw.setdefault("model", "m")
    kw.setdefault("max_tokens", 240)  # a thought of up to 120, then a forced call
    kw.setdefault("system", SYSTEM)
    kw.setdefault("messages", ASK)
    sampling = {k: kw.pop(k) for k in ("temperature", "top_p", "top_k") if k in kw}
    kw["extra_body"] = {"temperature": 0.0, **sampling, **kw.get("extra_body", {})}
    return claude.messages.create(**kw)


def test_tool_use_round_trip(claude):
    first = create(claude, tools=TOOLS, tool_choice={"type": "any"}, metadata={"user_id": "u1"})
    assert first.stop_reason == "tool_use" and first.id.startswith("msg_")
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name in ("get_weather", "search") and use.id
    if use.name == "get_weather":
        jsonschema.validate(use.input, WEATHER)
    assert first.usage.cache_read_input_tokens + first.usage.input_tokens > 0
    history = ASK + [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use.id,
                    "content": [{"type": "text", "text": "sunny"}],
                },
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    second = create(
        claude, messages=history, tools=TOOLS, tool_choice={"type": "none"}, max_tokens=6
    )
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content if b.type == "tool_use"] == []
    # everything before the new turn came from the radix cache
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= total - 8


def test_named_tool_streams_input_json(claude):
    """The tool_use block's input arrives in input_json_delta pieces as the model writes it;
    the SDK's accumulation equals the non-streaming answer's."""
    choice = {"type": "tool", "name": "search"}
    whole = create(claude, tools=TOOLS, tool_choice=choice)
    with claude.messages.stream(
        model="m",
        max_tokens=240,
        system=SYSTEM,
        messages=ASK,
        tools=TOOLS,
        tool_choice=choice,
        extra_body={"temperature": 0.0},
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"
              and e.delta.type == "input_json_delta"]  # fmt: skip
    assert len(pieces) > 2
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert use.name == "search" and use.input == {"query": UNICODE_ARGS["query"]}
    assert json.loads("".join(pieces)) == use.input
    assert [b.input for b in whole.content if b.type == "tool_use"] == [use.input]
    assert final.stop_reason == "tool_use"


def test_thinking_blocks(claude):
    """Thinking on: the template opens <think>; a regex forces thought, end marker, text.
    The thinking block is signed, streamed as a signature_delta."""
    body = {"regex": "[a-z]{3,10}</think>[a-z]{2,6}"}
    enabled = {"type": "enabled", "budget_tokens": 100}
    whole = create(claude, thinking=enabled, extra_body=body)
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking.isalpha() and whole.content[1].text.isalpha()
    assert len(whole.content[0].signature) > 20
    with claude.messages.stream(
        model="m",
        max_tokens=120,
        messages=ASK,
        system=SYSTEM,
        thinking=enabled,
        extra_body={**body, "temperature": 0.0},
    ) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "thinking_delta" in deltas and "text_delta" in deltas
    assert deltas.index("signature_delta") < deltas.index("text_delta")
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    off = create(claude, thinking={"type": "disabled"}, extra_body={"regex": "[a-z]{3,10}"})
    assert [b.type for b in off.content] == ["text"]


def answered_or_cut(message) -> bool:
    """An answer after the thought, or max_tokens said honestly: never an empty answer
    that claims the turn ended."""
    text = "".join(b.text for b in message.content if b.type == "text")
    return bool(text.strip()) or message.stop_reason == "max_tokens"


def test_thinking_budget_bounds_the_thought(claude, agent_model):
    """budget_tokens: the end marker is forced after that many thinking tokens; without a
    budget, after half of max_tokens, so the answer has room. Either way the answer is
    not empty, or the stop reason is max_tokens."""
    tokenizer = load_model(agent_model)[1]

    def thought_tokens(message) -> int:
        assert message.content[0].type == "thinking" and message.content[0].thinking
        return len(tokenizer.encode(message.content[0].thinking, add_special_tokens=False))

    free = create(claude, thinking={"type": "enabled"}, max_tokens=40)
    # (re-encoding the random model's thought can split it into a few more tokens)
    assert thought_tokens(free) <= 20 + 5 and answered_or_cut(free)
    assert [b.type for b in free.content] == ["thinking", "text"]
    bounded = create(claude, thinking={"type": "enabled", "budget_tokens": 6}, max_tokens=40)
    assert thought_tokens(bounded) <= 6 + 1 and answered_or_cut(bounded)
    for seed in range(4):  # sampled: the model would often end the turn right after </think>
        tight = create(claude, thinking={"type": "enabled", "budget_tokens": 2}, max_tokens=5,
                       temperature=1.0, extra_body={"seed": seed})  # fmt: skip
        assert answered_or_cut(tight), tight
    with pytest.raises(anthropic.BadRequestError, match="greater than `thinking.budget_tokens`"):
        create(claude, thinking={"type": "enabled", "budget_tokens": 40}, max_tokens=40)


def test_thinking_omitted_means_none(claude):
    """As on Anthropic's API: no `thinking`, no thinking block (the template closes it)."""
    regex = {"regex": "[a-z]{3,10}"}
    unsaid = create(claude, extra_body=regex)
    off = create(claude, thinking={"type": "disabled"}, extra_body=regex)
    assert [b.type for b in unsaid.content] == ["text"] and unsaid.content[0].text.isalpha()
    prompt = unsaid.usage.input_tokens + unsaid.usage.cache_read_input_tokens
    assert prompt == off.usage.input_tokens + off.usage.cache_read_input_tokens


def test_system_messages_among_the_messages(claude, server):
    """Claude Code sends `role: "system"` entries inside `messages`: each is system text
    at its position (the template renders it there), not a 400; an unknown role still is."""
    asked = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "system", "content": [{"type": "text", "text": "Answer in French."}]},
        {"role": "user", "content": "Please."},
    ]
    counted = claude.messages.count_tokens(model="m", system="be brief", messages=asked)
    plain = [{"role": "system", "content": "be brief"}] + [
        {"role": m["role"], "content": "Answer in French." if m["role"] == "system" else
         m["content"]} for m in asked
    ]  # fmt: skip
    ids = httpx.post(server.url + "/tokenize", json={"model": "m", "messages": plain},
                     headers={"x-api-key": KEY}).json()["tokens"]  # fmt: skip
    assert counted.input_tokens == len(ids)
    without = claude.messages.count_tokens(model="m", system="be brief", messages=asked[::2])
    assert without.input_tokens < counted.input_tokens  # rendered, not dropped
    out = create(claude, system="be brief", messages=asked, max_tokens=3)
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == counted.input_tokens
    for bad, needle in (({"role": "tool", "content": "x"}, "messages.1.role"),
                        ({"role": "system", "content": 5}, "messages.1.content")):  # fmt: skip
        with pytest.raises(anthropic.BadRequestError, match=needle):
            create(claude, messages=[asked[0], bad, asked[2]], max_tokens=3)


def test_unknown_beta_fields_are_ignored(claude):
    """Fields and beta headers this server does not know are accepted and ignored."""
    out = create(
        claude, max_tokens=3,
        extra_body={"context_management": {"edits": []}, "container": None, "mcp_servers": []},
        extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14,context-1m-2025-08-07"},
    )  # fmt: skip
    assert out.usage.output_tokens >= 1


def test_history_thinking_signatures_are_checked(claude):
    """A thinking block sent back must carry this server's signature of its text (400 as
    on Anthropic's API otherwise): the SDK's round trip passes, an edit does not."""
    body = {"regex": "[a-z]{3,10}</think>[a-z]{2,6}"}
    first = create(claude, thinking={"type": "enabled", "budget_tokens": 100}, extra_body=body)
    blocks = [b.model_dump() for b in first.content]
    follow = [{"role": "user", "content": "go on"}]
    ok = create(claude, messages=ASK + [{"role": "assistant", "content": blocks}] + follow,
                max_tokens=2)  # fmt: skip
    assert ok.usage.output_tokens >= 1
    for edit in ({"thinking": blocks[0]["thinking"] + "x"}, {"signature": "forged"}):
        bad = [{**blocks[0], **edit}, *blocks[1:]]
        history = ASK + [{"role": "assistant", "content": bad}] + follow
        with pytest.raises(anthropic.BadRequestError, match="Invalid `signature`"):
            create(claude, messages=history, max_tokens=2)


def test_stop_sequences_and_sampling(claude):
    off = {"type": "disabled"}
    forced = {"regex": "abcdefgh"}
    cut = create(claude, thinking=off, stop_sequences=["never", "cd"], extra_body=forced)
    assert (cut.stop_reason, cut.stop_sequence, cut.content[0].text) == (
        "stop_sequence",
        "cd",
        "ab",
    )
    whole = create(claude, thinking=off, stop_sequences=["never"], extra_body=forced)
    assert (whole.stop_reason, whole.content[0].text) == ("end_turn", "abcdefgh")
    short = create(claude, thinking=off, max_tokens=2, extra_body=forced)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2
    for seed in range(2):
        out = create(
            claude, max_tokens=6, temperature=1.0, top_p=0.9, top_k=20, extra_body={"seed": seed}
        )
        assert 1 <= out.usage.output_tokens <= 6


def test_output_config_json_schema(claude):
    fmt = {"format": {"type": "json_schema", "schema": WEATHER}}
    out = create(claude, output_config=fmt)
    (text,) = [b.text for b in out.content if b.type == "text"]
    jsonschema.validate(json.loads(text), WEATHER)


def test_count_tokens_equals_reported_prompt(claude):
    ask = [{"role": "user", "content": "a question nobody asked before: count me"}]
    counted = claude.messages.count_tokens(model="m", system="be brief", messages=ask, tools=TOOLS)
    out = create(claude, system="be brief", messages=ask, tools=TOOLS, max_tokens=2)
    assert counted.input_tokens == out.usage.input_tokens + out.usage.cache_read_input_tokens


def test_errors_are_anthropic_shaped(claude, server):
    with pytest.raises(anthropic.BadRequestError) as err:
        create(claude, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])
    assert err.value.body["type"] == "error" and "image" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
        create(claude, tools=TOOLS, tool_choice={"type": "tool", "name": "nope"})
    with pytest.raises(anthropic.NotFoundError):
        create(claude, model="claude-opus")
    bad = httpx.post(server.url + "/v1/messages", json={"model": "m"}, headers={"x-api-key": KEY})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    with anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError) as err:
            create(wrong)
    assert err.value.body["error"]["type"] == "authentication_error"
    # the guard's 401, answered before any route: one access-log line too
    assert log_lines(server, r"POST /v1/messages 401, .*error: invalid or missing API key")


def test_bearer_and_x_api_key_both_work(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as oai:
        assert (
            oai.completions.create(model="m", prompt="hi", max_tokens=2).usage.completion_tokens
            >= 1
        )
    no_key = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"})
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    with_key = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 1},
        headers={"x-api-key": KEY},
    )
    assert with_key.status_code == 200
    assert json.loads(with_key.text)["usage"]["completion_tokens"] == 1


def test_thinking_signatures_outlive_the_server(tmp_path):
    """Two signers (two runs of the server) on one key file sign alike; another file's
    signer refuses their blocks."""
    from router.api.thinking_signature import ThinkingSigner, stored_key

    path = tmp_path / "state" / "key"
    first, second = ThinkingSigner(stored_key(path)), ThinkingSigner(stored_key(path))
    assert second.valid("a thought", first.sign("a thought"))
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    other = ThinkingSigner(stored_key(tmp_path / "other"))
    assert not other.valid("a thought", first.sign("a thought"))
