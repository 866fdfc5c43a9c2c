"""The OpenAI Responses API (`POST /v1/responses`) through the official `openai` SDK
against a real server on the agent model (tests/agent_model.py: thinking and tool-call
tokens, a Qwen3-style template). Every body and stream event is parsed with the SDK's own
pydantic types; the random-weight model's outputs are pinned by greedy decoding, a forced
tool choice or a grammar, so what is checked is known."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.server import checked_server, log_lines

STORE_SIZE = 4
SERVER = ["--max-total-tokens", "8192", "--served-model-name", "m",
          "--responses-store-size", str(STORE_SIZE)]  # fmt: skip
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
GET_WEATHER = {"type": "function", "name": "get_weather", "description": "forecast",
               "parameters": WEATHER, "strict": True}  # fmt: skip
# what Codex and others send beside their functions: dropped, with one warning line
HOSTED = [
    {"type": "web_search"},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {"type": "custom", "name": "apply_patch", "description": "freeform"},
    {"type": "local_shell"},
    {"type": "namespace", "name": "mcp__x", "description": "d", "tools": []},
]
INSTRUCTIONS = "You are a helpful agent."
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def server(agent_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("responses") / "server.log"
    with checked_server(agent_model, log, SERVER) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        yield client


def create(oai, **kw) -> Response:
    """A non-streaming response, its raw JSON parsed as the SDK's Response type."""
    kw.setdefault("model", "m")
    kw.setdefault("temperature", 0)
    raw = oai.responses.with_raw_response.create(**kw)
    return Response.model_validate(raw.http_response.json())


def stream_events(oai, **kw) -> list:
    """A streamed response's events, each parsed as the SDK's typed stream event."""
    kw.setdefault("model", "m")
    kw.setdefault("temperature", 0)
    events = []
    with oai.responses.create(stream=True, **kw) as stream:
        for event in stream:
            events.append(
                STREAM_EVENT.validate_python(event.model_dump(exclude_unset=True, by_alias=True))
            )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    return events


def test_text_response_and_its_stream(oai):
    """A string input: one message item, usage that adds up; the stream's events build the
    same text, and end with the same Response."""
    out = create(oai, input="Hello there", instructions=INSTRUCTIONS, max_output_tokens=12)
    assert out.object == "response" and out.model == "m" and out.id.startswith("resp_")
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    (message,) = out.output
    assert message.type == "message" and message.role == "assistant" and out.output_text
    usage = out.usage
    assert usage.output_tokens == 12 and usage.total_tokens == usage.input_tokens + 12
    assert usage.output_tokens_details.reasoning_tokens == 0
    events = stream_events(oai, input="Hello there", instructions=INSTRUCTIONS,
                           max_output_tokens=12)  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]  # fmt: skip
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == out.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == out.output_text and final.usage.output_tokens == 12
    assert final.usage.input_tokens == usage.input_tokens


def test_greedy_output_equals_the_chat_route(oai):
    """The same conversation as Responses items and as chat messages: the same prompt,
    so the same greedy tokens and text. A developer message is system text."""
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Which days?"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Tomorrow."}]},
    ]  # fmt: skip
    messages = [{"role": "system", "content": INSTRUCTIONS},
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "Which days?"},
                {"role": "user", "content": "Tomorrow."}]  # fmt: skip
    out = create(oai, input=items, instructions=INSTRUCTIONS, max_output_tokens=24, store=False)
    chat = oai.chat.completions.create(model="m", messages=messages, max_tokens=24, temperature=0)
    assert out.output_text == chat.choices[0].message.content and out.usage.output_tokens > 1
    assert out.usage.input_tokens == chat.usage.prompt_tokens
    assert out.usage.output_tokens == chat.usage.completion_tokens


def test_previous_response_id_continues_from_the_cache(oai):
    """A stored response continues its conversation: the next turn's prompt extends the
    ids the model saw and wrote, so the radix cache covers all of the first turn (but its
    last token, whose KV was never computed); streamed, the same."""
    first = create(oai, input="Plan a trip.", instructions=INSTRUCTIONS, max_output_tokens=16)
    second = create(oai, input="Shorter, please.", instructions=INSTRUCTIONS,
                    previous_response_id=first.id, max_output_tokens=16)  # fmt: skip
    whole_first = first.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > whole_first
    assert second.usage.input_tokens_details.cached_tokens >= whole_first - 1
    events = stream_events(oai, input="And a third turn.", instructions=INSTRUCTIONS,
                           previous_response_id=second.id, max_output_tokens=8)  # fmt: skip
    third = events[-1].response
    whole_second = second.usage.input_tokens + second.usage.output_tokens
    assert third.usage.input_tokens_details.cached_tokens >= whole_second - 1
    assert oai.responses.retrieve(third.id).output_text == third.output_text


def test_store_bounds_gone_ids_and_delete(oai):
    """The store keeps the last --responses-store-size responses: an older id, a deleted
    one and one never stored are 404s that name the id."""
    kept = [create(oai, input=f"turn {i}", max_output_tokens=2) for i in range(STORE_SIZE + 1)]
    gone = kept[0].id
    with pytest.raises(openai.NotFoundError, match=gone) as err:
        create(oai, input="again", previous_response_id=gone, max_output_tokens=2)
    assert err.value.body["type"] == "invalid_request_error"
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError, match=gone):
        oai.responses.retrieve(gone)
    last = kept[-1].id
    assert oai.responses.retrieve(last).id == last
    items = oai.responses.input_items.list(last)
    assert [i.content[0].text for i in items.data] == [f"turn {STORE_SIZE}"]
    oai.responses.delete(last)
    with pytest.raises(openai.NotFoundError, match=last):
        oai.responses.retrieve(last)
    unstored = create(oai, input="not kept", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)


def test_function_call_round_trip_with_hosted_tools_dropped(oai, server):
    """A forced call parses against the schema; its output continues the conversation by
    previous_response_id or by sending the items back; the hosted tools beside it are
    dropped with one warning line per request; streamed, the arguments come as deltas."""
    warned = len(log_lines(server, "dropped tools", timeout=0))
    tools = [GET_WEATHER, *HOSTED]
    choice = {"type": "function", "name": "get_weather"}
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    first = create(oai, input=ask, tools=tools, tool_choice=choice, max_output_tokens=200)
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert [t.type for t in first.tools] == ["function"]
    assert len(log_lines(server, "dropped tools")) == warned + 1
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}
    second = create(oai, input=[result], previous_response_id=first.id, tools=tools,
                    tool_choice="none", max_output_tokens=8)  # fmt: skip
    assert second.output[0].type == "message"
    whole_first = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= whole_first - 1
    sent_back = [*ask, call.model_dump(exclude_none=True), result]
    replayed = create(oai, input=sent_back, tools=tools, tool_choice="none", max_output_tokens=8)
    assert replayed.output[0].type == "message"
    events = stream_events(oai, input=ask, tools=tools, tool_choice=choice,
                           max_output_tokens=200)  # fmt: skip
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(pieces) > 2 and "".join(pieces) == done.arguments == call.arguments
    assert events[-1].type == "response.completed"
    assert len(log_lines(server, "dropped tools")) == warned + 4  # one per request


def test_a_call_cut_short_is_incomplete(oai):
    """A forced call that max_output_tokens cuts inside its arguments: the function_call
    item streamed so far says incomplete, and so does the response."""
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 400}},
              "required": ["text"]}  # fmt: skip
    write = {"type": "function", "name": "write", "parameters": schema}
    choice = {"type": "function", "name": "write"}  # its header, then 400 characters at least
    out = create(oai, input="Write!", tools=[write], tool_choice=choice, max_output_tokens=40)
    assert out.status == "incomplete"
    call = out.output[0]
    assert call.type == "function_call" and call.status == "incomplete"
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.arguments)


def test_parallel_tool_calls(oai):
    """Two calls in one answer (written by a regex): both are function_call items, in
    order, streamed or not; with parallel_tool_calls false, the first alone."""
    calls = [("Paris", 1), ("Rome", 2)]
    regex = "".join(
        rf'<tool_call>\n\{{"name": "get_weather", "arguments": \{{"city": "{city}", '
        rf'"days": {days}\}}\}}\n</tool_call>\n'
        for city, days in calls
    )
    kw = dict(input="Weather in Paris and Rome?", tools=[GET_WEATHER], max_output_tokens=200,
              extra_body={"regex": regex})  # fmt: skip
    both = create(oai, **kw)
    assert [(c.name, json.loads(c.arguments)) for c in both.output] == [
        ("get_weather", {"city": city, "days": days}) for city, days in calls
    ]
    events = stream_events(oai, **kw)
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [item.type for item in added] == ["function_call", "function_call"]
    assert [c.arguments for c in events[-1].response.output] == [c.arguments for c in both.output]
    first = create(oai, **kw, parallel_tool_calls=False)
    assert [c.arguments for c in first.output] == [both.output[0].arguments]
    assert first.parallel_tool_calls is False
    events = stream_events(oai, **kw, parallel_tool_calls=False)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == both.output[0].arguments


def test_text_format_json_schema(oai):
    """text.format holds the answer to the schema through the grammar engine; the SDK's
    stream helper assembles the same completed response."""
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    out = create(oai, input="Weather in Paris?", text={"format": fmt}, max_output_tokens=120)
    assert out.status == "completed" and out.text.format.type == "json_schema"
    jsonschema.validate(json.loads(out.output_text), WEATHER)
    with oai.responses.stream(model="m", input="Weather in Paris?", text={"format": fmt},
                              max_output_tokens=120, temperature=0) as stream:  # fmt: skip
        final = stream.get_final_response()
    assert final.output_text == out.output_text
    obj = create(oai, input="Weather?", text={"format": {"type": "json_object"}},
                 max_output_tokens=60)  # fmt: skip
    assert obj.status == "incomplete" or isinstance(json.loads(obj.output_text), dict)


def test_reasoning_summary_and_encrypted_round_trip(oai):
    """reasoning.effort turns the template's thinking on: a reasoning item (the thought as
    summary text, reasoning_tokens counted) before a JSON answer; its encrypted_content
    comes back verified and rendered into the prompt; a forged one is a 400."""
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER}
    kw = dict(input="Weather in Paris?", text={"format": fmt}, max_output_tokens=160,
              reasoning={"effort": "high", "summary": "auto"},
              include=["reasoning.encrypted_content"])  # fmt: skip
    out = create(oai, **kw)
    reasoning, message = out.output
    thought = reasoning.summary[0].text
    assert reasoning.type == "reasoning" and thought.strip() and reasoning.encrypted_content
    assert 0 < out.usage.output_tokens_details.reasoning_tokens < out.usage.output_tokens
    jsonschema.validate(json.loads(message.content[0].text), WEATHER)
    events = stream_events(oai, **kw)
    summary = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
    assert summary == thought
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    answer = message.model_dump(exclude_none=True)
    then = {"role": "user", "content": "Thanks."}
    without = create(oai, input=[*ask, answer, then], max_output_tokens=1, store=False)
    sent = reasoning.model_dump(exclude_none=True)
    with_thought = create(oai, input=[*ask, sent, answer, then], max_output_tokens=1, store=False)
    assert with_thought.usage.input_tokens > without.usage.input_tokens + 2
    forged = dict(sent, encrypted_content=sent["encrypted_content"].replace(".", "x.", 1))
    with pytest.raises(openai.BadRequestError, match="encrypted_content") as err:
        create(oai, input=[*ask, forged, answer, then], max_output_tokens=1)
    assert err.value.body["param"] == "input[1].encrypted_content"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]},
         "input[1].role"),
        ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
         "input[0].arguments"),
        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"input": "hi", "tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
        ({"input": "hi", "max_output_tokens": "9"}, "max_output_tokens"),
        ({"input": "hi", "temperature": -1.0}, "temperature"),
        ({"input": "hi", "top_p": 2.0}, "top_p"),
        ({"input": "hi", "background": True}, None),
        ({"input": "hi", "truncation": "middle"}, None),
        ({}, None),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    reply = httpx.post(f"{server.url}/v1/responses", json={"model": "m", **body}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


@pytest.mark.slow
def test_prompt_cache_key_keeps_requests_on_one_replica(agent_model, tmp_path_factory):
    """Two replicas: requests with one prompt_cache_key and unrelated prompts all go to the
    replica the key picks (reason `route_key` in the routing metrics)."""
    log = tmp_path_factory.mktemp("responses-dp") / "server.log"
    with checked_server(agent_model, log, [*SERVER, "--dp-size", "2"]) as srv:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client:
            for i, prompt in enumerate(["alpha", "a b c d e f", "zz top", "7 8 9"]):
                create(client, input=prompt * (i + 1), prompt_cache_key="session-1",
                       max_output_tokens=2)  # fmt: skip
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
    assert 'reason="route_key"} 4.0' in metrics
    routed = [line for line in metrics.splitlines()
              if line.startswith("radix_mlx_replica_requests_total{")]  # fmt: skip
    assert sorted(float(line.split()[-1]) for line in routed)[-1] >= 4.0, routed


@pytest.mark.slow
def test_a_failure_midway_is_an_error_event_then_response_failed(oai, server):
    """Runs last in the module: it kills the worker mid-stream (the server restarts it).
    The stream ends with an `error` event and `response.failed` carrying the reason."""
    events, killed = [], False
    with oai.responses.create(model="m", input="Go on.", stream=True, max_output_tokens=3000,
                              extra_body={"ignore_eos": True}) as stream:  # fmt: skip
        for event in stream:
            events.append(STREAM_EVENT.validate_python(event.model_dump(exclude_unset=True)))
            if not killed and event.type.endswith(".delta") and len(events) > 5:
                os.kill(server.child("worker"), signal.SIGKILL)
                killed = True
    error, failed = events[-2:]
    assert error.type == "error" and "worker process exited" in error.message
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.error.message == error.message
    deadline = time.monotonic() + 120
    while httpx.get(server.url + "/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the server did not recover"
        time.sleep(0.5)
