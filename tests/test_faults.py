"""Fault injection on a real server: killed, stopped and fed garbage, it restarts what died,
fails exactly what was in flight, and then serves token-exact again with an empty pool.

One server for the module (each restart costs a model load, ~3 s on the tiny model); every
test ends with `assert_recovered`: /health 200, a greedy request equal to mlx-lm's own,
and no running, queued or held slot when idle.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import threading
import time

import httpx
import pytest
import zmq

from benchmarks.sse import aiter_sse_data
from common.messages import (
    DecodeBatch,
    GenerateReq,
    SamplingParams,
    StepResult,
    TokenOut,
    TokenOutBatch,
)
from common.protocol import encode
from router.client import Client, RadixMLXError
from router.serving.supervisor import STANDBY_IDLE
from tests.conftest import mlx_greedy
from tests.server import ServerProcess, title_role
from tests.test_metrics import PREFIX, scrape, wait_idle

pytestmark = pytest.mark.slow
WATCHDOG = 4  # seconds: far above a tiny-model step, short enough to wait for


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("faults") / "server.log"
    extra = ["--max-total-tokens", "16384", "--watchdog-timeout", str(WATCHDOG)]
    srv = ServerProcess(tiny_model, log, extra=[*extra, "--max-restarts", "50"])
    srv.start()
    yield srv
    srv.stop()


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


def _body(prompt, max_tokens: int, stream: bool = False) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}  # fmt: skip


def wait_healthy(server: ServerProcess, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert server.proc.poll() is None, server.log(40)
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, server.log(40)
        time.sleep(0.05)


def assert_recovered(server: ServerProcess, model: str, seed: int = 0) -> None:
    wait_healthy(server)
    prompt = _prompts(1, seed + 1000)[0]
    r = httpx.post(server.url + "/v1/completions", json=_body(prompt, 8), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == mlx_greedy(model, prompt, 8)
    wait_idle(server.url, timeout=15)


def restarts(server: ServerProcess, process: str) -> float:
    return scrape(server.url)[PREFIX + f'process_restarts_total{{process="{process}"}}']


def runtime_dir(server: ServerProcess) -> str:
    return re.search(r"runtime directory (\S+)", server.log())[1]


async def _stream(http: httpx.AsyncClient, url: str, body: dict, first: asyncio.Event | None):
    """(token ids, the error event's message or None) of one streamed completion."""
    ids, error = [], None
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for data in aiter_sse_data(r):
            if data == "[DONE]":
                continue
            event = json.loads(data)
            if "error" in event:
                error = event["error"]["message"]
                continue
            ids += event["choices"][0]["token_ids"]
            if first is not None:
                first.set()
    return ids, error


def _stopped(pid: int):
    """SIGSTOP `pid` for the with-block (SIGCONT after, if it still exists)."""

    class _Stopped:
        def __enter__(self):
            os.kill(pid, signal.SIGSTOP)

        def __exit__(self, *exc):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    return _Stopped()


def _post_in_thread(url: str, body: dict) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        out["response"] = httpx.post(url + "/v1/completions", json=body, timeout=120)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def _wait_log(server: ServerProcess, needle: str, count: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while server.log().count(needle) < count:
        assert time.monotonic() < deadline, f"{needle!r} x{count} not in log"
        time.sleep(0.02)


def test_sigkill_worker_during_prefill(server, tiny_model):
    before = restarts(server, "worker")
    worker = server.child("worker")
    prefills = server.log().count("Prefill batch")
    with _stopped(worker):  # the extend is sent and cannot finish: the kill lands mid-step
        thread, out = _post_in_thread(server.url, _body(_prompts(1, 1)[0], 8))
        _wait_log(server, "Prefill batch", prefills + 1)
        os.kill(worker, signal.SIGKILL)
    thread.join(30)
    r = out["response"]
    assert r.status_code == 503, r.text
    assert "worker process exited with status -9 (SIGKILL)" in r.json()["error"]["message"]
    assert_recovered(server, tiny_model, 1)
    assert restarts(server, "worker") == before + 1


def test_sigkill_worker_during_decode_with_16_streams(server, tiny_model):
    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            firsts = [asyncio.Event() for _ in range(16)]
            bodies = [_body(p, 2000, stream=True) for p in _prompts(16, 2)]
            tasks = [asyncio.create_task(_stream(http, server.url, b, f))
                     for b, f in zip(bodies, firsts)]  # fmt: skip
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 30)
            os.kill(server.child("worker"), signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 30)

    results = asyncio.run(run())
    for ids, error in results:
        assert ids and len(ids) < 2000
        assert error is not None and "worker process exited with status -9" in error, error
    assert_recovered(server, tiny_model, 2)


def test_sdk_stream_in_flight_raises_radix_mlx_error(server, tiny_model):
    with Client(server.zmq_address, timeout=60) as client:
        chunks = client.stream(input_ids=[5, 6, 7], max_new_tokens=3000, ignore_eos=True)
        assert next(chunks).token_ids
        os.kill(server.child("worker"), signal.SIGKILL)
        with pytest.raises(RadixMLXError, match="worker process exited") as caught:
            for _ in chunks:
                pass
        assert caught.value.status == 503
    assert_recovered(server, tiny_model, 9)


def test_sigkill_scheduler_and_requests_during_the_restart_are_served(server, tiny_model):
    before = restarts(server, "scheduler")
    prefills = server.log().count("Prefill batch")
    thread, out = _post_in_thread(server.url, _body([5, 6, 7], 3000))
    _wait_log(server, "Prefill batch", prefills + 1)  # it reached the scheduler
    os.kill(server.child("scheduler"), signal.SIGKILL)
    thread.join(30)
    assert out["response"].status_code == 503
    assert "scheduler process exited with status -9" in out["response"].text
    # a request sent right after the death waits for the restart and is served
    prompt = _prompts(1, 3)[0]
    r = httpx.post(server.url + "/v1/completions", json=_body(prompt, 6), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == mlx_greedy(tiny_model, prompt, 6)
    assert restarts(server, "scheduler") == before + 1
    assert_recovered(server, tiny_model, 3)


def test_sigstopped_worker_past_the_watchdog_is_restarted(server, tiny_model):
    before = restarts(server, "worker")
    worker = server.child("worker")
    with _stopped(worker):
        started = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", json=_body([4, 4, 4], 8), timeout=60)
        waited = time.monotonic() - started
    assert r.status_code == 503, r.text
    assert "did not complete within 4 s (--watchdog-timeout)" in r.json()["error"]["message"]
    assert waited >= WATCHDOG - 0.5
    assert_recovered(server, tiny_model, 4)
    assert restarts(server, "worker") == before + 1
    assert server.child("worker") != worker


def test_sigterm_to_the_worker_alone_restarts_it(server, tiny_model):
    worker = server.child("worker")
    before = restarts(server, "worker")
    os.kill(worker, signal.SIGTERM)  # an operator's kill: the router is not stopping
    deadline = time.monotonic() + 30
    while restarts(server, "worker") == before:
        assert time.monotonic() < deadline, server.log(20)
        time.sleep(0.1)
    assert_recovered(server, tiny_model, 11)
    assert server.child("worker") != worker
    assert "worker process exited with status 0; restarting" in server.log()


def _wait_restarted(server: ServerProcess, before: float) -> None:
    """Until the router has counted the death (a /health 200 before that is stale)."""
    deadline = time.monotonic() + 30
    while restarts(server, "worker") == before:
        assert time.monotonic() < deadline, server.log(20)
        time.sleep(0.05)


def test_a_restart_releases_the_standbys_and_spawns_new_ones(server, tiny_model):
    standbys = {name: server.child(f"{name}-standby", 60) for name in ("worker", "scheduler")}
    before = restarts(server, "worker")
    os.kill(server.child("worker"), signal.SIGKILL)
    _wait_restarted(server, before)
    assert_recovered(server, tiny_model, 12)
    for name, pid in standbys.items():  # the standby now serves, under the role's title
        assert server.child(name) == pid
        assert server.child(f"{name}-standby", 60) not in standbys.values()


def test_standbys_wait_for_a_quiet_moment(tiny_model, tmp_path):
    """Spawned as the server became ready, the standbys' imports took a core from the first
    requests: they come once nothing was in flight for STANDBY_IDLE."""
    srv = ServerProcess(tiny_model, tmp_path / "server.log")
    srv.start()
    try:
        stop = time.monotonic() + STANDBY_IDLE + 3
        seen: list[str] = []

        def send() -> None:
            while time.monotonic() < stop:
                r = httpx.post(srv.url + "/v1/completions", json=_body([5, 6, 7], 16), timeout=60)
                assert r.status_code == 200, r.text

        senders = [threading.Thread(target=send) for _ in range(2)]
        for t in senders:
            t.start()
        while any(t.is_alive() for t in senders):
            seen += _standby_roles(srv)
            time.sleep(0.1)
        assert not seen, "a standby was spawned while requests were in flight"
        assert srv.child("worker-standby", STANDBY_IDLE + 60)  # and once it was quiet
        assert srv.child("scheduler-standby")
    finally:
        srv.stop()


def _standby_roles(srv: ServerProcess) -> list[str]:
    roles = []
    for pid in srv.children():
        try:
            roles.append(title_role(open(f"/proc/{pid}/cmdline", "rb").read()))
        except FileNotFoundError:
            continue
    return [role for role in roles if role.endswith("-standby")]


def test_a_dead_standby_is_replaced_by_a_fresh_spawn(server, tiny_model):
    standby = server.child("worker-standby", 60)
    os.kill(standby, signal.SIGKILL)
    before = restarts(server, "worker")
    os.kill(server.child("worker"), signal.SIGKILL)
    _wait_restarted(server, before)
    assert_recovered(server, tiny_model, 13)
    assert server.child("worker") != standby


def test_sigstopped_scheduler_is_restarted(server, tiny_model):
    scheduler = server.child("scheduler")
    with _stopped(scheduler):
        r = httpx.post(server.url + "/v1/completions", json=_body([4, 5, 6], 8), timeout=60)
    assert r.status_code == 503, r.text
    assert "scheduler sent nothing for" in r.json()["error"]["message"]
    assert_recovered(server, tiny_model, 10)
    assert server.child("scheduler") != scheduler


def _bad_frames() -> list[bytes]:
    valid = [
        encode(GenerateReq("x-bad", [1, 2, 3], SamplingParams())),
        encode(TokenOutBatch([TokenOut("x-bad", [1], None, 3, 1, 0)])),
        encode(DecodeBatch(99999, ["x-bad"], [1])),
        encode(StepResult(99999, ["x-bad"], [1])),
    ]
    rng = random.Random(5)
    frames = [
        b"\xc1garbage",
        b"",
        b"\x93\x01\x02\x03",
        bytes(rng.randrange(256) for _ in range(64)),
    ]
    frames += [v[: len(v) // 2] for v in valid]  # truncated
    frames += [v.replace(b"x-bad", b"\xff\xfe\xfd\xfc\xfb") for v in valid]  # bad utf-8
    return frames + valid[:1] + valid[2:3]  # well-formed, but wrong socket or step


def test_garbage_and_truncated_frames_on_every_socket(server, tiny_model):
    rt = runtime_dir(server)
    ctx = zmq.Context()
    try:
        for name in ("scheduler.sock", "router.sock", "worker.sock", "scheduler-worker.sock"):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(f"ipc://{os.path.join(rt, name)}")
            for frame in _bad_frames():
                sock.send(frame)
            sock.close()
        door = ctx.socket(zmq.DEALER)
        door.setsockopt(zmq.LINGER, 0)
        door.connect(server.zmq_address)
        for frame in _bad_frames():
            door.send(frame)
            assert door.poll(10_000), "the front door did not answer a bad frame"
            door.recv()
    finally:
        ctx.destroy(linger=1000)
    time.sleep(0.5)
    assert "Traceback" not in server.log()
    assert_recovered(server, tiny_model, 5)


def test_undecodable_frame_while_a_step_is_in_flight_hangs_nothing(server, tiny_model):
    worker = server.child("worker")
    prefills = server.log().count("Prefill batch")
    ctx = zmq.Context()
    try:
        with _stopped(worker):
            thread, out = _post_in_thread(server.url, _body(_prompts(1, 6)[0], 50))
            _wait_log(server, "Prefill batch", prefills + 1)
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(f"ipc://{os.path.join(runtime_dir(server), 'worker.sock')}")
            sock.send(b"\xc1not a frame")
            sock.close()
        thread.join(30)
    finally:
        ctx.destroy(linger=1000)
    assert not thread.is_alive(), "the request hung"
    r = out["response"]
    # The worker answers in arrival order across its two senders, which zmq fair-queues:
    # if the bad frame's WorkerError comes while a step of the request is in flight, the
    # request fails with it (tests/test_scheduler_faults.py pins that order down); if it
    # comes between steps, it is dropped. Either way nothing waits for ever.
    if r.status_code != 200:
        assert r.status_code == 500 and "bad frame" in r.json()["error"]["message"], r.text
    assert server.child("worker") == worker  # not a death: nothing restarted
    assert_recovered(server, tiny_model, 6)


def test_100_streaming_clients_that_disconnect_at_random(server, tiny_model):
    rng = random.Random(7)

    async def client(http: httpx.AsyncClient, prompt, max_tokens: int, keep: int):
        body = _body(prompt, max_tokens, stream=True)
        async with http.stream("POST", server.url + "/v1/completions", json=body) as r:
            seen = 0
            async for _ in aiter_sse_data(r):
                seen += 1
                if seen >= keep:
                    return  # leaving the block closes the connection mid-stream

    async def run():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http:
            jobs = [client(http, p, rng.randrange(2, 80), rng.randrange(0, 40))
                    for p in _prompts(100, 7)]  # fmt: skip
            await asyncio.gather(*jobs)

    asyncio.run(run())
    assert_recovered(server, tiny_model, 7)


def test_64_concurrent_streams_lose_nothing_and_are_token_exact(server, tiny_model):
    prompts = _prompts(64, 8)

    async def run():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            jobs = [_stream(http, server.url, _body(p, 24, stream=True), None) for p in prompts]
            return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    for prompt, (ids, error) in zip(prompts, results):
        assert error is None
        assert ids == mlx_greedy(tiny_model, prompt, 24)
    assert_recovered(server, tiny_model, 8)


def _refused_during_the_restart(server: ServerProcess) -> None:
    """With --restart-wait-timeout 0, a request sent while the restart cannot finish (its
    standby worker is stopped) gets a 503 with Retry-After at once."""
    with _stopped(server.child("worker-standby", 60)):
        os.kill(server.child("worker"), signal.SIGKILL)
        while httpx.get(server.url + "/health", timeout=5).status_code == 200:
            time.sleep(0.02)
        r = httpx.post(server.url + "/v1/completions", json=_body([4, 5], 2), timeout=10)
        assert r.status_code == 503, r.text
        assert "restarting" in r.json()["error"]["message"] and r.headers["Retry-After"]


def test_crash_loop_ends_with_one_clear_line(tiny_model, tmp_path):
    extra = ["--max-restarts", "2", "--restart-wait-timeout", "0"]
    server = ServerProcess(tiny_model, tmp_path / "log", extra=extra)
    server.start()
    try:
        _refused_during_the_restart(server)
        for _ in range(2):
            wait_healthy(server)
            os.kill(server.child("worker"), signal.SIGKILL)
            time.sleep(0.3)
        assert server.proc.wait(30) == 1
        log = server.log()
        assert log.count("giving up") == 1
        assert "giving up: worker process exited with status -9 (SIGKILL), and 2 restarts " \
               "within 600 s reached --max-restarts 2" in log  # fmt: skip
        assert "Traceback" not in log
    finally:
        server.stop()
