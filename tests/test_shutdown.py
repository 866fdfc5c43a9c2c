"""Graceful drain on SIGTERM, an immediate stop on the second signal, and a SIGTERM to the
whole process group (what systemd and container runtimes send) that stops everything
without a traceback."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

from benchmarks.sse import iter_sse_data
from tests.server import ServerProcess, exited

pytestmark = pytest.mark.slow


def _start(model: str, tmp_path, timeout: float, group: bool = False) -> ServerProcess:
    extra = ["--max-total-tokens", "40000", "--graceful-shutdown-timeout", str(timeout)]
    server = ServerProcess(model, tmp_path / "log", extra=extra)
    server.new_session = group
    server.start()
    return server


ACCESS_LINE = re.compile(r" router\] (GET|POST|HEAD|PUT|DELETE|OPTIONS) /")


def _router_lines(server: ServerProcess) -> list[str]:
    """The router's own lines, without the access log's (a request's line is written when
    it ends, which may be after the shutdown's)."""
    lines = server.log().splitlines()
    return [line for line in lines if " router] " in line and not ACCESS_LINE.search(line)]


class _Stream(threading.Thread):
    """A streamed completion read to its end: token ids, last finish reason, errors."""

    def __init__(self, server: ServerProcess, max_tokens: int):
        super().__init__()
        self.url, self.max_tokens = server.url, max_tokens
        self.ids, self.finish, self.errors = [], None, []
        self.first = threading.Event()
        self.start()

    def run(self) -> None:
        body = {"prompt": [5, 6, 7], "max_tokens": self.max_tokens, "ignore_eos": True,
                "stream": True, "temperature": 0}  # fmt: skip
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
            for data in iter_sse_data(r):
                if not data.startswith("{"):
                    continue
                event = json.loads(data)
                if "error" in event:
                    self.errors.append(event["error"]["message"])
                    continue
                choice = event["choices"][0]
                self.ids += choice["token_ids"]
                self.finish = choice["finish_reason"] or self.finish
                self.first.set()


def test_group_sigterm_drains_in_flight_streams(tiny_model, tmp_path):
    server = _start(tiny_model, tmp_path, 30, group=True)
    try:
        children = [server.child("worker"), server.child("scheduler")]
        # long enough to be running still when the late request comes, on a fast machine
        streams = [_Stream(server, 2400) for _ in range(3)]
        assert all(s.first.wait(30) for s in streams)
        os.killpg(server.proc.pid, signal.SIGTERM)  # the router, the worker, the scheduler
        time.sleep(0.5)  # the children got the signal too: they must keep serving
        health = httpx.get(server.url + "/health", timeout=5)
        assert health.status_code == 503 and "draining" in health.text
        late = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, timeout=5)
        assert late.status_code == 503 and "draining" in late.json()["error"]["message"]
        for s in streams:
            s.join(60)
            assert (len(s.ids), s.finish, s.errors) == (2400, "length", [])
        assert server.proc.wait(30) == 0
        assert exited(children)
        assert "Traceback" not in server.log()
        said = _router_lines(server)
        assert "SIGTERM: draining 3 request(s)" in said[-3], said[-3:]
        assert re.search(r"\] drained in [\d.]+ s$", said[-2]), said[-3:]
        assert said[-1].endswith("] stopped"), said[-3:]
    finally:
        server.stop()


def test_drain_timeout_fails_what_is_still_running(tiny_model, tmp_path):
    server = _start(tiny_model, tmp_path, 1)
    try:
        stream = _Stream(server, 30000)
        assert stream.first.wait(30)
        server.proc.send_signal(signal.SIGTERM)
        stream.join(30)
        assert stream.finish is None and len(stream.ids) < 30000
        assert len(stream.errors) == 1 and "--graceful-shutdown-timeout 1 s" in stream.errors[0]
        assert server.proc.wait(30) == 0
        assert "Traceback" not in server.log()
    finally:
        server.stop()


def test_second_signal_stops_at_once(tiny_model, tmp_path):
    server = _start(tiny_model, tmp_path, 600)
    try:
        children = [server.child("worker"), server.child("scheduler")]
        stream = _Stream(server, 30000)
        assert stream.first.wait(30)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert server.proc.poll() is None  # draining, for up to 600 s
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(15) == 0
        assert exited(children)
        stream.join(30)
        assert stream.finish is None
        assert "Traceback" not in server.log()
        said = _router_lines(server)
        assert said[-2].endswith("SIGINT: stopping now") and said[-1].endswith("] stopped"), said
        assert "drained in" not in server.log()
    finally:
        server.stop()
