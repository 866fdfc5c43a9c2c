"""Tools on every model: the default tiny model (what `make run-local` serves), whose chat
template names no tool format, takes tools in the generic format (router/api/generic_tools.py)
and answers forced calls through the official `openai` and `anthropic` SDKs."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from tests.server import checked_server
from tests.test_tools_api import ASK, TOOLS, WEATHER

pytestmark = pytest.mark.slow

SERVER = ["--max-total-tokens", "4096", "--served-model-name", "m"]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("generic-tools") / "server.log"
    with checked_server(tiny_model, log, SERVER) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        yield client


def chat(oai, **kw):
    return oai.chat.completions.create(**{"model": "m", "temperature": 0, "max_tokens": 120, **kw})


def test_openai_forced_call_round_trips(oai):
    first = chat(oai, messages=ASK, tools=TOOLS, tool_choice="required")
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "search")
    if call.function.name == "get_weather":
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'},
    ]
    second = chat(oai, messages=history, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert second.choices[0].message.tool_calls is None
    # the call was written back as the model wrote it: the first turn's prompt is cached
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 4


def test_openai_named_call_streams(oai):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model="m", temperature=0, max_tokens=120, messages=ASK, tools=TOOLS)
    with oai.chat.completions.stream(**kw, tool_choice=choice) as stream:
        final = stream.get_final_completion().choices[0]
    (call,) = final.message.tool_calls
    assert final.finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_anthropic_forced_call_round_trips(server):
    tools = [{"name": "get_weather", "description": "forecast", "input_schema": WEATHER}]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0) as claude:
        first = claude.messages.create(
            model="m", max_tokens=120, messages=ask, tools=tools,
            tool_choice={"type": "any"}, extra_body={"temperature": 0.0},
        )  # fmt: skip
        assert first.stop_reason == "tool_use"
        (use,) = [b for b in first.content if b.type == "tool_use"]
        assert use.name == "get_weather"
        jsonschema.validate(use.input, WEATHER)
        result = {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}
        second = claude.messages.create(
            model="m", max_tokens=4, tools=tools, extra_body={"temperature": 0.0},
            messages=ask + [{"role": "assistant", "content": first.content},
                            {"role": "user", "content": [result]}],
        )  # fmt: skip
        assert second.usage.cache_read_input_tokens >= first.usage.input_tokens - 4
