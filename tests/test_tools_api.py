"""Tool calls, structured output and reasoning through the official `openai` SDK against
a real server on the agent model (tests/agent_model.py: thinking and tool-call tokens, a
Qwen3-style template). The random-weight model's outputs are forced by grammars (a tool
choice that must call, a response format, a regex), so what is parsed is known."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.conftest import load_model
from tests.server import checked_server

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
UNICODE_ARGS = {"query": "Zürich 東京 😀", "filter": {"tags": ["a", {"deep": [1, 2.5, None]}]}}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"const": UNICODE_ARGS["query"]},
                    "filter": {"const": UNICODE_ARGS["filter"]},
                },
                "required": ["query", "filter"],
                "additionalProperties": False,
            },
        },
    },
]
ASK = [
    {"role": "system", "content": "You are a helpful agent."},
    {"role": "user", "content": "Weather in Paris?"},
]


AGENT_SERVER = ["--max-total-tokens", "8192", "--debug-invariants", "--served-model-name", "m"]


@pytest.fixture(scope="module")
def server(agent_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("tools") / "server.log"
    with checked_server(agent_model, log, AGENT_SERVER) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        yield client


def chat(oai, **kw):
    kw.setdefault("model", "m")
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 240)  # a thought of up to 120, then a forced answer
    return oai.chat.completions.create(**kw)


def test_tool_round_trip(oai):
    """required -> a parsable call -> its result in the history -> an answer; the second
    turn reuses the first turn's prompt from the radix cache."""
    first = chat(oai, messages=ASK, tools=TOOLS, tool_choice="required")
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    assert call.function.name in ("get_weather", "search")
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        jsonschema.validate(args, WEATHER)
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny", "high": 21}'},
    ]
    second = chat(oai, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.choices[0].message.tool_calls is None
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 8


def test_named_function_with_unicode_nested_arguments(oai):
    choice = {"type": "function", "function": {"name": "search"}}
    out = chat(oai, messages=ASK, tools=TOOLS, tool_choice=choice).choices[0]
    (call,) = out.message.tool_calls
    assert call.function.name == "search"
    assert json.loads(call.function.arguments) == UNICODE_ARGS


def streamed(oai, **kw):
    """(the SDK's accumulated choice, the arguments deltas it got) of a streamed chat."""
    pieces = []
    with oai.chat.completions.stream(**kw) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                pieces.append(event.arguments_delta)
        return stream.get_final_completion().choices[0], pieces


def test_tool_call_arguments_stream_as_written(oai):
    """The call's name first, then its arguments in pieces as the model writes them, which
    the SDK's stream accumulates into the same call as the non-streaming answer's."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = chat(oai, messages=ASK, tools=TOOLS, tool_choice=choice).choices[0].message
    kw = dict(model="m", temperature=0, max_tokens=240, messages=ASK, tools=TOOLS)
    final, pieces = streamed(oai, **kw, tool_choice=choice)
    assert final.finish_reason == "tool_calls" and not (final.message.content or "").strip()
    (call,) = final.message.tool_calls
    assert call.function.name == "get_weather"
    assert call.function.arguments == whole.tool_calls[0].function.arguments
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert len([p for p in pieces if p]) > 2 and "".join(pieces) == call.function.arguments


def test_required_call_always_parses(oai):
    for seed in range(4):
        out = chat(
            oai, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed
        )
        (call,) = out.choices[0].message.tool_calls
        assert call.function.name in ("get_weather", "search")
        json.loads(call.function.arguments)


def test_reasoning_is_split(oai):
    """Thinking asked for by reasoning_effort (the template opens <think>); a regex forces
    thought, end marker, answer."""
    regex = "[a-z]{3,10}</think>[a-z]{2,6}"
    think = {"reasoning_effort": "medium", "extra_body": {"regex": regex}}
    out = chat(oai, messages=ASK, **think).choices[0].message
    assert out.model_extra["reasoning_content"].isalpha()
    assert out.content.isalpha() and "think" not in out.content
    stream = chat(oai, messages=ASK, **think, stream=True)
    reasoning, content = "", ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
    assert (reasoning, content) == (out.model_extra["reasoning_content"], out.content)


def test_thinking_comes_before_a_json_answer_and_a_forced_call(oai):
    """Thinking on: the model thinks first, for at most half of max_tokens, then the
    grammar holds the answer to the schema or to a call."""
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    on = {"chat_template_kwargs": {"enable_thinking": True}}
    out = chat(oai, messages=ASK, response_format=fmt, extra_body=on).choices[0].message
    assert out.model_extra["reasoning_content"].strip()
    jsonschema.validate(json.loads(out.content), WEATHER)
    out = chat(oai, messages=ASK, tools=TOOLS, tool_choice="required", extra_body=on)
    out = out.choices[0].message
    assert out.model_extra["reasoning_content"].strip()
    (call,) = out.tool_calls
    json.loads(call.function.arguments)


def test_chat_template_kwargs_reach_the_template(oai):
    """enable_thinking false: the template closes the thinking block itself, so the output
    is all content (the same regex's end marker is then plain content). A request that
    says nothing of thinking (no chat_template_kwargs, no reasoning_effort) gets none."""
    body = {"regex": "[a-z]{3,10}", "chat_template_kwargs": {"enable_thinking": False}}
    out = chat(oai, messages=ASK, extra_body=body)
    assert out.choices[0].message.content.isalpha()
    assert "reasoning_content" not in (out.choices[0].message.model_extra or {})
    on = {"regex": "[a-z]{3,10}", "chat_template_kwargs": {"enable_thinking": True}}
    thinking = chat(oai, messages=ASK, extra_body=on)
    assert thinking.usage.prompt_tokens < out.usage.prompt_tokens  # "<think>\n" vs a closed block
    regex = {"regex": "[a-z]{3,10}"}
    unsaid = chat(oai, messages=ASK, extra_body=regex)
    effortless = chat(oai, messages=ASK, reasoning_effort="none", extra_body=regex)
    for off in (unsaid, effortless):
        assert off.usage.prompt_tokens == out.usage.prompt_tokens
        assert "reasoning_content" not in (off.choices[0].message.model_extra or {})


@pytest.mark.parametrize(
    "schema",
    [
        WEATHER,
        {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}, "maxItems": 3},
        {"anyOf": [{"type": "integer", "maximum": 99, "minimum": 0}, {"type": "boolean"}]},
    ],
)
def test_json_schema_output_validates(oai, schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}
    out = chat(
        oai,
        messages=ASK,
        response_format=fmt,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)


def test_json_object_and_completions_regex(oai, agent_model):
    """json_object: whatever the logits prefer (here "}", biased up), the output is an object."""
    close = load_model(agent_model)[1].encode("}", add_special_tokens=False)
    body = {"chat_template_kwargs": {"enable_thinking": False}}
    out = chat(
        oai, messages=ASK, response_format={"type": "json_object"}, extra_body=body,
        logit_bias={str(t): 50 for t in close},
    )  # fmt: skip
    assert out.choices[0].finish_reason == "stop"
    assert json.loads(out.choices[0].message.content) == {}
    done = oai.completions.create(
        model="m", prompt="id:", max_tokens=20, temperature=0,
        extra_body={"regex": "[0-9]{4}-[A-Z]{2}"},
    )  # fmt: skip
    assert len(done.choices[0].text) == 7 and done.choices[0].text[4] == "-"


@pytest.mark.parametrize(
    "body,needle",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "frob"}},
                }
            },
            "frob",
        ),
        ({"extra_body": {"regex": "a[b"}}, "unclosed character class"),
        ({"extra_body": {"ebnf": "root ::= nothing"}}, "'nothing' not found"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "nope",
        ),
        ({"tool_choice": "required"}, "needs tools"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"regex": "a"}}, "at most one"),
    ],
)
def test_bad_constraints_are_400(oai, body, needle):
    with pytest.raises(openai.BadRequestError) as err:
        chat(oai, messages=ASK, **body)
    assert needle in err.value.body["message"]
