"""Forced tool calls through the official `openai` SDK on servers whose model writes tool
calls in other mlx-lm formats than hermes' `<tool_call>` JSON (tests/test_tools_api.py):
Mistral's `[TOOL_CALLS]name[ARGS]{...}` (JSON arguments, streamed as written, no end
marker) and Qwen3-Coder's XML (one tag per parameter, the call sent whole). The agent
model's template in that format makes mlx-lm pick the parser; the grammar follows it."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.agent_model import build_agent_model
from tests.server import checked_server
from tests.test_tools_api import AGENT_SERVER, ASK, TOOLS, UNICODE_ARGS, WEATHER, streamed


@pytest.fixture(scope="module", params=["mistral", "qwen3_coder"])
def oai(request, tiny_model, model_cache, tmp_path_factory):
    kind = request.param
    model = build_agent_model(tiny_model, Path(model_cache) / f"agent-tiny-{kind}", kind)
    log = tmp_path_factory.mktemp(f"tools-{kind}") / "server.log"
    with checked_server(model, log, AGENT_SERVER) as srv:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client:
            client.tool_format = kind
            yield client


# No thinking: the XML format's tags take many of the random model's tokens, so calls stay
# short (thinking before a forced call is tested in tests/test_tools_api.py)
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
BASE = dict(model="m", temperature=0, max_tokens=240, messages=ASK, tools=TOOLS)


def chat(oai, **kw):
    return oai.chat.completions.create(**(BASE | {"extra_body": NO_THINKING} | kw))


def test_required_call_parses_and_round_trips(oai):
    first = chat(oai, tool_choice="required")
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = first.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name in ("get_weather", "search")
    if call.function.name == "get_weather":
        jsonschema.validate(args, WEATHER)
    else:
        assert args == UNICODE_ARGS
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    second = chat(oai, messages=history, tool_choice="none", max_tokens=4)
    assert second.choices[0].message.tool_calls is None
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 8


def test_named_call_streams_like_the_whole_answer(oai):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = chat(oai, tool_choice=choice).choices[0].message.tool_calls[0]
    jsonschema.validate(json.loads(whole.function.arguments), WEATHER)
    final, pieces = streamed(oai, **BASE, tool_choice=choice, extra_body=NO_THINKING)
    (call,) = final.message.tool_calls
    assert final.finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == json.loads(whole.function.arguments)
    if oai.tool_format == "mistral":  # JSON arguments: streamed as the model writes them
        assert call.function.arguments == whole.function.arguments
        assert len([p for p in pieces if p]) > 2
    else:  # one tag per parameter: the call arrives whole at its end marker
        assert len(pieces) == 1
