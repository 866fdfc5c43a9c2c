"""The `radix-mlx` command line: each subcommand's own flags, --version, and flags that
cannot work refused in one line before the model loads (ports out of range, addresses
already in use), with real processes and a real socket holding the port."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import socket
import subprocess

import pytest

from common.server_args import ServerArgs
from tests.server import RADIX_MLX


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
