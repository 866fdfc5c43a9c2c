"""The agents' Python clients, unchanged, against a real `radix-mlx serve` on the scripted
agent model (tests/scripted_agent_model.py: offered `get_weather`, it calls it with
{"city": "Paris"}; once the result is back, it answers ANSWER):

- openai-agents: its default model (the Responses API) and its chat model, with a
  function tool that runs;
- LangChain `ChatOpenAI`, with `use_responses_api=True` and without: a tool round trip,
  and structured output;
- LiteLLM: chat (a tool round trip), the Anthropic route and `litellm.responses()`;
- instructor (in a venv of its own, tests/clients/instructor.txt): a Pydantic answer
  through a forced tool call and a JSON schema on chat, and through the Responses API
  (which sends both a forced call and a text.format);
- the README's "Use it with your agent" Python blocks, as written, pointed at the server.

The versions are the `clients` extra's, pinned in pyproject.toml.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict

from tests.cli_agents import SERVED, readme_settings
from tests.scripted_agent_model import ANSWER, SCRIPTS
from tests.server import checked_server, log_lines

pytestmark = pytest.mark.slow
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of a price list
ASK = "What is the weather in Paris?"
WEATHER = "sunny, 21 C"
CALL = SCRIPTS["get_weather"]
TIMEOUT = 60  # seconds, for any one request
INSTRUCTOR = Path(__file__).parent.parent / ".cache" / "clients" / "instructor" / "bin" / "python"


def get_weather(city: str) -> str:
    """The weather in a city."""
    calls.append(city)
    return WEATHER


calls: list[str] = []  # the cities get_weather ran for
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


class Trip(BaseModel):
    """A structured answer whose every value the grammar bounds (the model is random): with
    other keys allowed, a random model may write one key forever."""

    model_config = ConfigDict(extra="forbid")

    city: Literal["Paris", "Rome"]
    days: Literal[1, 2, 3]


@pytest.fixture(scope="module")
def server(scripted_agent_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("python-agents") / "server.log"
    with checked_server(scripted_agent_model, log, SERVED) as srv:
        yield srv


@pytest.fixture(autouse=True)
def no_calls():
    calls.clear()


def test_openai_agents_runs_a_tool(server):
    import agents
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=TIMEOUT)
    tool = agents.function_tool(get_weather)
    for model in (
        agents.OpenAIResponsesModel("local", client),  # the SDK's default kind of model
        agents.OpenAIChatCompletionsModel("local", client),
    ):
        agent = agents.Agent(name="weather", instructions="Be brief.", model=model, tools=[tool])
        result = agents.Runner.run_sync(agent, ASK, max_turns=3)
        assert result.final_output == ANSWER
        assert calls == [CALL["city"]]
        outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
        assert [o.output for o in outputs] == [WEATHER]
        calls.clear()
    assert log_lines(server, r"POST /v1/responses 200")


@pytest.mark.parametrize("responses_api", [False, True], ids=["chat", "responses"])
def test_langchain_tools_and_structured_output(server, responses_api):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model="local", base_url=server.url + "/v1", api_key="-", max_retries=0, temperature=0,
        timeout=TIMEOUT, use_responses_api=responses_api, max_tokens=64,
    )  # fmt: skip
    history = [HumanMessage(ASK)]
    call = llm.bind_tools([get_weather]).invoke(history)
    (tool_call,) = call.tool_calls
    assert tool_call["name"] == "get_weather" and tool_call["args"] == CALL
    history += [call, ToolMessage(get_weather(**tool_call["args"]), tool_call_id=tool_call["id"])]
    answer = llm.bind_tools([get_weather]).invoke(history)
    assert answer.text == ANSWER and not answer.tool_calls
    trip = llm.with_structured_output(Trip).invoke("Plan a short trip.")
    assert isinstance(trip, Trip)


@pytest.mark.skipif(not INSTRUCTOR.exists(), reason="make clients installs instructor")
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA", "RESPONSES_TOOLS"])
def test_instructor_returns_a_validated_model(server, mode):
    script = Path(__file__).parent / "clients" / "instructor_trip.py"
    args = [str(INSTRUCTOR), str(script), server.url + "/v1", mode]
    done = subprocess.run(args, capture_output=True, text=True, timeout=2 * TIMEOUT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert Trip.model_validate_json(done.stdout)


def test_litellm_chat_anthropic_and_responses(server):
    import litellm

    base = dict(api_base=server.url + "/v1", api_key="-", max_tokens=64, timeout=TIMEOUT)
    messages = [{"role": "user", "content": ASK}]
    out = litellm.completion(model="openai/local", messages=messages, tools=[WEATHER_TOOL], **base)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == CALL
    messages += [
        out.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": WEATHER},
    ]
    out = litellm.completion(model="openai/local", messages=messages, tools=[WEATHER_TOOL], **base)
    assert out.choices[0].message.content == ANSWER
    assert out.usage.prompt_tokens_details.cached_tokens > 0

    # the Anthropic route: LiteLLM's Anthropic provider against our /v1/messages
    anthropic_base = dict(api_base=server.url, api_key="-", max_tokens=64, timeout=TIMEOUT)
    out = litellm.completion(model="anthropic/local", messages=[{"role": "user", "content": "hi"}],
                             **anthropic_base)  # fmt: skip
    assert out.choices[0].message.content == ANSWER
    msg = asyncio.run(  # (LiteLLM's sync create is not implemented)
        litellm.anthropic.messages.acreate(
            model="anthropic/local", messages=[{"role": "user", "content": "hi"}], **anthropic_base
        )
    )
    assert msg["content"] == [{"type": "text", "text": ANSWER}]
    assert log_lines(server, r"POST /v1/messages 200")

    response = litellm.responses(model="openai/local", input="hi", api_base=server.url + "/v1",
                                 api_key="-", max_output_tokens=64, timeout=TIMEOUT)  # fmt: skip
    assert response.output[-1].content[0].text == ANSWER


def test_the_readme_python_settings(server):
    """The README's blocks run one after the other, as a reader would paste them."""
    namespace: dict = {"__name__": "readme"}
    for block in readme_settings("python", server.url):
        exec(compile(block, "README.md", "exec", dont_inherit=True), namespace)
    assert namespace["result"].final_output == ANSWER  # openai-agents, its tool run
    outputs = [i.output for i in namespace["result"].new_items if i.type == "tool_call_output_item"]
    assert outputs == ["sunny, 21 C"]
    assert namespace["call"].tool_calls[0]["args"] == CALL  # LangChain
    assert namespace["city"].name in ("Paris", "Lyon", "Nice")
    assert namespace["chat"].choices[0].message.content == ANSWER  # LiteLLM
    assert namespace["claude_style"].choices[0].message.content == ANSWER
    assert namespace["response"].output[-1].content[0].text == ANSWER
