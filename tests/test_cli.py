"""The `radix-mlx` command line: each subcommand's own flags, --version, and flags that
cannot work refused in one line before the model loads (ports out of range, addresses
already in use), with real processes and a real socket holding the port."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import socket
import subprocess

import httpx
import pytest

from common.server_args import ServerArgs
from tests.server import RADIX_MLX, ServerProcess


def _run(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([RADIX_MLX, *argv], capture_output=True, text=True, timeout=timeout,
                          env=env)  # fmt: skip


@contextlib.contextmanager
def _held_port():
    """A port a real listening socket holds (another server on it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_version_and_a_real_description():
    out = _run("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"radix-mlx {importlib.metadata.version('radix-mlx')}"
    text = _run("--help").stdout
    assert "prefix cache" in text and "replica" in text and "--version" in text


@pytest.mark.parametrize(
    "command, foreign",
    [
        ("serve", ["--listen", "tcp://127.0.0.1:31000"]),
        ("serve", ["--curve-authorized-keys", "keys"]),
        ("replica", ["--port", "8000"]),
        ("replica", ["--api-key", "k"]),
        ("replica", ["--replica", "tcp://127.0.0.1:31000"]),
    ],
)
def test_a_subcommand_refuses_another_ones_flag(command, foreign):
    out = _run(command, "--model-path", "m", *foreign)
    assert out.returncode == 2
    assert f"unrecognized arguments: {' '.join(foreign)}" in out.stderr


@pytest.mark.parametrize(
    "kw, line",
    [
        ({"port": 99999}, "--port 99999: a TCP port is 1..65535"),
        ({"port": 0}, "--port 0: a TCP port is 1..65535"),
        ({"zmq_port": 70000}, "--zmq-port 70000: a TCP port is 1..65535"),
        ({"port": 65535}, "--port 65535 leaves no port + 1 for the SDK: give --zmq-port"),
        ({"port": 8000, "zmq_port": 8000}, "--zmq-port 8000 is --port's too"),
        ({"dist_port": 65535, "tp_size": 2}, "--dist-port (rank 1) 65536: a TCP port"),
        ({"dist_port": -1}, "--dist-port -1: a TCP port is 1..65535"),
        ({"listen": "tcp://127.0.0.1:99999"}, "--listen tcp://127.0.0.1:99999: a TCP port"),
        ({"listen": "tcp://127.0.0.1"}, "--listen tcp://127.0.0.1: expected tcp://HOST:PORT"),
        ({"replica": ["tcp://h:0"], "dp_size": 0}, "--replica tcp://h:0: a TCP port is 1..65535"),
        ({"replica": ["h:1"]}, "--replica h:1: expected tcp://HOST:PORT"),
    ],
)
def test_every_port_flag_is_checked(kw, line):
    with pytest.raises(ValueError) as exc:
        ServerArgs(model_path="m", **kw).validate()
    assert line in str(exc.value)


def test_a_port_out_of_range_is_one_line(tiny_model):
    out = _run("serve", "--model-path", tiny_model, "--port", "99999")
    assert out.returncode == 1
    (line,) = out.stderr.strip().splitlines()
    assert line.endswith("--port 99999: a TCP port is 1..65535")


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--port", "{held}"], "--port"),
        (["--port", "{free}", "--zmq-port", "{held}"], "--zmq-port"),
        (["--port", "{below}"], "--zmq-port (default: --port + 1)"),
    ],
    ids=["http", "zmq", "zmq-default"],
)
def test_serve_refuses_an_address_in_use_before_the_model_loads(tiny_model, flags, named):
    with _held_port() as held, socket.socket() as spare:
        spare.bind(("127.0.0.1", 0))
        free = spare.getsockname()[1]
        spare.close()
        argv = [f.format(held=held, free=free, below=held - 1) for f in flags]
        out = _run("serve", "--model-path", tiny_model, *argv)
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()  # no traceback, nothing loaded
    assert line.endswith(f"{named}: cannot listen on 127.0.0.1:{held}: the address is "
                         "already in use (another server on that port?)")  # fmt: skip


def test_a_replica_refuses_a_listen_address_in_use(tiny_model):
    with _held_port() as held:
        out = _run("replica", "--model-path", tiny_model, "--listen", f"tcp://127.0.0.1:{held}")
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert f"--listen: cannot listen on 127.0.0.1:{held}: the address is already in use" in line


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--tool-call-parser", "nope"], "--tool-call-parser 'nope' is unknown; choose one of: "),
        (["--chat-template", "{missing}"], "cannot read it: No such file or directory"),
        (["--chat-template", "{bad}"], "not a Jinja template (line 1)"),
    ],
    ids=["parser", "missing-template", "bad-template"],
)
def test_chat_overrides_are_checked_in_one_line_before_the_model_loads(
    tiny_model, tmp_path, flags, needle
):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in %}{{ m }}")
    argv = [f.format(missing=tmp_path / "none.jinja", bad=bad) for f in flags]
    out = _run("serve", "--model-path", tiny_model, *argv)
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert needle in line
    if "parser" in flags[0]:
        assert "generic" in line and "json_tools" in line and "qwen3_coder" in line


@pytest.mark.slow
def test_a_chat_template_file_and_a_tool_parser_replace_the_model_s(tiny_model, tmp_path):
    """The served chat renders with the file's template; with it, mlx-lm would detect
    the json_tools format, which --tool-call-parser generic overrides (the tools are in
    the system text the router writes, not in the template's own tools section)."""
    template = tmp_path / "chat.jinja"
    template.write_text(
        "{% if tools %}TEMPLATE-TOOLS <tool_call>{{ tool_call.name }}{% endif %}"
        "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}### assistant:{% endif %}"
    )
    extra = ["--chat-template", str(template), "--tool-call-parser", "generic"]
    server = ServerProcess(tiny_model, tmp_path / "log", extra=extra)
    server.start()
    try:
        tool = {"type": "function", "function": {"name": "lookup", "parameters": {}}}
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool],
                "tool_choice": "required", "max_tokens": 60, "temperature": 0}  # fmt: skip
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "lookup"
        ids = httpx.post(server.url + "/tokenize", json={"messages": body["messages"]}).json()
        text = httpx.post(server.url + "/detokenize", json={"tokens": ids["tokens"]}).json()
        assert text["prompt"] == "### user: hi\n### assistant:"
    finally:
        server.stop()
