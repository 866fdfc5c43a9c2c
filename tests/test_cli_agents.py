"""The coding agents' own CLIs, unchanged, against a real `radix-mlx serve` on the scripted
agent model (tests/scripted_agent_model.py: it calls the agent's shell tool with
`echo radix-mlx-tool-ran`, then answers once the result is back):

- Claude Code headless (`claude -p --output-format stream-json`) with the environment
  the README's "Use it with your agent" gives, its ANTHROPIC_BASE_URL at the server: a
  request round trip, and a tool round trip: tool_use, the tool runs, tool_result, and
  the next turn reads the whole conversation so far from the cache;
- Codex (`codex exec --json`) with the README's config.toml (a provider with
  `wire_api = "responses"`), its base_url at the server: a turn completes, and a
  function call round-trips the same way.

The CLIs are the ones `make clients` pins in tests/clients/package-lock.json.
"""

from __future__ import annotations

import re

import pytest

from tests.cli_agents import SERVED, cli, json_lines, readme_settings, run_cli
from tests.scripted_agent_model import ANSWER, SCRIPTS
from tests.server import checked_server, log_lines

pytestmark = pytest.mark.slow
RAN = "radix-mlx-tool-ran"  # what the scripted `echo` prints


@pytest.fixture(scope="module")
def server(scripted_agent_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("cli-agents") / "server.log"
    with checked_server(scripted_agent_model, log, SERVED) as srv:
        yield srv


def claude(server, tmp_path, *args: str) -> list[dict]:
    """`claude -p` headless in the README's environment; its stream-json events."""
    (exports,) = [b for b in readme_settings("bash", server.url) if "ANTHROPIC_BASE_URL" in b]
    env = dict(line.removeprefix("export ").split("=", 1) for line in exports.splitlines())
    assert env["ANTHROPIC_BASE_URL"] == server.url and "ANTHROPIC_MODEL" in env
    cmd = [cli("claude"), "-p", *args, "--output-format", "stream-json", "--verbose"]
    return json_lines(run_cli(cmd, tmp_path, env).stdout)


def messages(events: list[dict], role: str) -> list[dict]:
    return [e["message"] for e in events if e["type"] == role]


def test_claude_code_request_round_trip(server, tmp_path):
    events = claude(server, tmp_path, "say hi", "--tools", "")
    (reply,) = messages(events, "assistant")
    assert reply["content"] == [{"type": "text", "text": ANSWER}]
    result = events[-1]
    assert result["type"] == "result" and result["subtype"] == "success", result
    assert result["result"] == ANSWER and not result["is_error"]
    assert log_lines(server, r"POST /v1/messages 200, .*#generated-token: 2$")


def test_claude_code_tool_round_trip_hits_the_cache(server, tmp_path):
    allowed = f"Bash({SCRIPTS['Bash']['command']})"
    events = claude(server, tmp_path, "print a word", "--tools", "Bash",
                    "--allowedTools", allowed, "--max-turns", "3")  # fmt: skip
    call, answer = messages(events, "assistant")
    (tool_use,) = call["content"]
    assert tool_use["type"] == "tool_use" and tool_use["name"] == "Bash"
    assert tool_use["input"] == SCRIPTS["Bash"]
    (result,) = messages(events, "user")[0]["content"]
    assert result == {"tool_use_id": tool_use["id"], "type": "tool_result", "content": RAN,
                      "is_error": False}  # fmt: skip
    assert answer["content"] == [{"type": "text", "text": ANSWER}]
    # the turn after the tool result reads all of the first turn's prompt from the cache
    # but its end (the generation prompt, which the history renders otherwise)
    first, then = call["usage"], answer["usage"]
    first_prompt = first["input_tokens"] + first["cache_read_input_tokens"]
    assert first_prompt - 16 <= then["cache_read_input_tokens"] < first_prompt
    assert then["input_tokens"] < 200
    assert events[-1]["subtype"] == "success" and events[-1]["result"] == ANSWER
    cached = then["cache_read_input_tokens"]
    assert log_lines(server, rf"POST /v1/messages 200, .*#cached-token: {cached}, ")


def test_codex_turn_with_a_function_call_round_trip(server, tmp_path):
    """`codex exec` through a `wire_api = "responses"` provider: the model calls Codex's
    exec_command, Codex runs it (no sandbox: the command is the script's `echo`) and
    sends its output back, and the turn completes with the answer."""
    home = tmp_path / "codex"
    home.mkdir()
    (config,) = readme_settings("toml", server.url)
    (home / "config.toml").write_text(config)
    env = {"CODEX_HOME": str(home), "RADIX_MLX_API_KEY": "dummy"}
    cmd = [cli("codex"), "exec", "--json", "--skip-git-repo-check",
           "--sandbox", "danger-full-access", "print a word"]  # fmt: skip
    events = json_lines(run_cli(cmd, tmp_path, env, timeout=240).stdout)
    items = [e["item"] for e in events if e["type"] == "item.completed"]
    (command,) = [i for i in items if i["type"] == "command_execution"]
    assert SCRIPTS["exec_command"]["cmd"] in command["command"]
    assert command["exit_code"] == 0 and command["aggregated_output"] == RAN + "\n"
    assert [i["text"] for i in items if i["type"] == "agent_message"] == [ANSWER]
    (done,) = [e for e in events if e["type"] == "turn.completed"]
    assert done["usage"]["output_tokens"] == 4  # the call's 2 tokens, the answer's 2
    # the request after the call reads the first one's prompt from the cache, all but
    # its generation prompt
    first, then = log_lines(server, r"POST /v1/responses 200")[-2:]
    prompt = int(re.search(r"#prompt-token: (\d+)", first)[1])
    cached = [int(re.search(r"#cached-token: (\d+)", line)[1]) for line in (first, then)]
    assert prompt - 16 <= cached[1] < prompt
    assert done["usage"]["cached_input_tokens"] == sum(cached)  # Codex's sum over its requests
