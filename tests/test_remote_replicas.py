"""Remote replicas: `radix-mlx replica` processes on loopback tcp, reached through the
router's RemoteLink (router/replicas/remote_replica.py), with and without CURVE keys.

The router's side here is the link itself, read as the router's manager reads it
(`LinkReader`); tests/test_remote_serve.py runs `radix-mlx serve --replica`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time

import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio
import zmq.auth
from hypothesis import given, settings
from hypothesis import strategies as st

from common import curve
from common.messages import (
    REPLICA_CONTROL,
    REPLICA_CONTROL_INBOX,
    REPLICA_INBOX,
    ROUTER_INBOX,
    AbortReq,
    GenerateReq,
    ReplicaFrameError,
    ReplicaPing,
    ReplicaStatus,
    ReqError,
    SamplingParams,
    SchedulerReady,
    TokenOutBatch,
)
from common.model_identity import model_identity
from common.protocol import ProtocolError, decode, encode
from common.server_args import ServerArgs
from router.replicas.remote_replica import RemoteLink
from tests.conftest import mlx_greedy
from tests.server import RADIX_MLX, ReplicaProcess, ServerProcess, exited
from tests.test_faults import _post_in_thread
from tests.test_fuzz_decoders import _mutate, values
from tests.test_metrics import PREFIX, delta, scrape, wait_for
from tests.test_replicas_e2e import _health

pytestmark = pytest.mark.slow
POOL = ["--max-total-tokens", "4096"]


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("keys") / "k"
    done = subprocess.run([RADIX_MLX, "keys", "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return str(out)


def replica_keys(keys: str) -> list[str]:
    return ["--curve-secret-key", f"{keys}/replica.key_secret",
            "--curve-authorized-keys", f"{keys}/authorized"]  # fmt: skip


def router_args(model: str, keys: str | None) -> ServerArgs:
    if keys is None:
        return ServerArgs(model_path=model)
    return ServerArgs(model_path=model, curve_secret_key=f"{keys}/router.key_secret",
                      curve_server_key=f"{keys}/replica.key")  # fmt: skip


@pytest.fixture(scope="module")
def keyed_replica(tiny_model, keys, tmp_path_factory):
    log = tmp_path_factory.mktemp("replica") / "replica.log"
    replica = ReplicaProcess(tiny_model, log, extra=[*POOL, *replica_keys(keys)])
    replica.start()
    yield replica
    replica.stop()
    assert "Traceback" not in replica.log()


class LinkReader:
    """The router's end of one link, read as the manager reads it: every frame decoded
    with the router's registry, into a queue; states as they change."""

    def __init__(self, address: str, model: str, args: ServerArgs):
        self.ctx = zmq.asyncio.Context()
        self.states: list[tuple[float, str, str]] = []
        self.link = RemoteLink(address, model_identity(model), args, self.ctx, self._on_state)
        self.frames: asyncio.Queue = asyncio.Queue()

    def _on_state(self, link: RemoteLink) -> None:
        self.states.append((time.monotonic(), link.state, link.reason))

    async def __aenter__(self) -> LinkReader:
        self.link.start()
        self.reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc) -> None:
        self.reader.cancel()
        self.link.close()
        self.ctx.destroy(linger=0)

    async def _read(self) -> None:
        while True:
            self.frames.put_nowait(decode(await self.link.recv(), ROUTER_INBOX))

    async def wait_state(self, state: str, timeout: float = 20) -> str:
        deadline = time.monotonic() + timeout
        while self.link.state != state:
            assert time.monotonic() < deadline, f"still {self.link.state}: {self.link.reason}"
            await asyncio.sleep(0.05)
        return self.link.reason

    async def generate(self, rid: str, prompt: list[int], n: int) -> list[int] | ReqError:
        sampling = SamplingParams(max_new_tokens=n, temperature=0)
        await self.link.send(encode(GenerateReq(rid, prompt, sampling)))
        tokens = []
        while True:
            msg = await asyncio.wait_for(self.frames.get(), 30)
            if isinstance(msg, ReqError) and msg.rid == rid:
                return msg
            if isinstance(msg, TokenOutBatch):
                for out in msg.outputs:
                    assert out.rid == rid
                    tokens += out.token_ids
                    if out.finish_reason is not None:
                        return tokens


def reader(address: str, model: str, keys: str | None) -> LinkReader:
    return LinkReader(address, model, router_args(model, keys))


def run(coro):
    return asyncio.run(coro)


def test_keyed_link_serves_mlx_lm_greedy_tokens(keyed_replica, tiny_model, keys):
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 100, 200, 300, 5, 6, 7, 8, 11]]

    async def go():
        async with reader(keyed_replica.address, tiny_model, keys) as r:
            await r.wait_state("ready")
            assert r.link.ready.num_slots == 4096 and r.link.ready.model_type == "qwen3"
            return [await r.generate(f"p{i}", p, 12) for i, p in enumerate(prompts)]

    outputs = run(go())
    assert outputs == [mlx_greedy(tiny_model, p, 12) for p in prompts]


def _prefills(replica: ReplicaProcess) -> int:
    return replica.log().count("Prefill batch")


@pytest.mark.parametrize("who", ["wrong key", "no keys"])
def test_a_router_without_the_right_key_is_refused(keyed_replica, tiny_model, keys, tmp_path,
                                                   who):  # fmt: skip
    if who == "wrong key":
        _, secret = zmq.auth.create_certificates(tmp_path, "intruder")
        args = ServerArgs(model_path=tiny_model, curve_secret_key=secret,
                          curve_server_key=f"{keys}/replica.key")  # fmt: skip
        expected = "does not admit this router's CURVE key"
    else:
        args = router_args(tiny_model, None)
        expected = "the replica needs CURVE keys and this router has none"
    before = _prefills(keyed_replica)

    async def go():
        async with LinkReader(keyed_replica.address, tiny_model, args) as r:
            reason = await r.wait_state("refused")
            sent = r.link.send_nowait(encode(GenerateReq("x", [1, 2, 3], SamplingParams())))
            await asyncio.sleep(0.5)
            return reason, sent, r.link.ready

    reason, sent, ready = run(go())
    assert expected in reason
    assert not sent and ready is None  # nothing can be sent: there is no connection
    assert _prefills(keyed_replica) == before
    assert "Traceback" not in keyed_replica.log()


def test_a_replica_of_another_model_is_refused(keyed_replica, tiny_model, tiny_llama, keys):
    async def go():
        async with reader(keyed_replica.address, tiny_llama, keys) as r:
            return await r.wait_state("refused"), r.link.ready

    reason, ready = run(go())
    assert reason.startswith("another model: it serves model_type qwen3")
    assert "this router serves model_type llama" in reason and ready is None


@pytest.mark.parametrize(
    "listen, extra, line",
    [
        ("tcp://0.0.0.0:{port}", [], "refusing to listen on tcp://0.0.0.0:{port} without CURVE"),
        ("tcp://*:{port}", [], "refusing to listen on tcp://*:{port} without CURVE keys"),
        ("tcp://127.0.0.1:{port}", ["--curve-secret-key", "k"], "go together"),
        ("ipc:///tmp/x", [], "--listen ipc:///tmp/x: expected tcp://HOST:PORT"),
        ("tcp://127.0.0.1:{port}", ["--model-path", "m2"], "a replica serves one model"),
    ],
)
def test_a_replica_refuses_flags_that_cannot_work(tiny_model, listen, extra, line):
    port = 31999
    cmd = [RADIX_MLX, "replica", "--model-path", tiny_model,
           "--listen", listen.format(port=port), *extra]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and line.format(port=port) in lines[0]


def test_a_killed_worker_fails_in_flight_then_the_replica_rejoins(keyed_replica, tiny_model, keys):
    async def go():
        async with reader(keyed_replica.address, tiny_model, keys) as r:
            await r.wait_state("ready")
            instance = r.link.instance
            sampling = SamplingParams(max_new_tokens=4000, temperature=0, ignore_eos=True)
            await r.link.send(encode(GenerateReq("long", [5, 6, 7], sampling)))
            first = await asyncio.wait_for(r.frames.get(), 30)  # tokens flow, or stats
            os.kill(keyed_replica.child("worker"), signal.SIGKILL)
            error = None
            while error is None:
                msg = await asyncio.wait_for(r.frames.get(), 30)
                error = msg if isinstance(msg, ReqError) else None
            await r.wait_state("starting")
            await r.wait_state("ready", timeout=60)
            again = await r.generate("after", [1, 2, 3, 4], 6)
            return first, error, instance, r.link.instance, again

    first, error, before, after, again = run(go())
    assert first is not None
    assert error.rid == "long" and error.status == 503
    assert f"replica {keyed_replica.address}: worker process exited" in error.message
    assert before == after  # the same replica process restarted its children
    assert again == mlx_greedy(tiny_model, [1, 2, 3, 4], 6)


def test_a_killed_replica_is_down_within_2_s_and_rejoins_when_back(tiny_model, tmp_path):
    replica = ReplicaProcess(tiny_model, tmp_path / "a.log", extra=POOL)
    replica.start()
    try:
        run(_kill_and_return(replica, tiny_model, tmp_path))
    finally:
        replica.stop()


async def _kill_and_return(replica: ReplicaProcess, model: str, tmp_path) -> None:
    async with reader(replica.address, model, None) as r:
        await r.wait_state("ready")
        first = r.link.instance
        children = replica.children()
        replica.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        await r.wait_state("down", timeout=5)
        down_after = r.states[-1][0] - killed
        assert down_after < 2.0  # the bound
        assert "no answer from the replica" in r.link.reason
        replica.proc.wait()
        assert exited(children), "the replica's children outlived it"
        back = ReplicaProcess(model, tmp_path / "b.log", extra=POOL, port=replica.port)
        with _stopping(back):
            back.start()
            await r.wait_state("ready", timeout=60)
            assert r.link.instance != first
            assert await r.generate("back", [3, 4, 5], 5) == mlx_greedy(model, [3, 4, 5], 5)


@contextlib.contextmanager
def _stopping(proc: ReplicaProcess):
    try:
        yield proc
    finally:
        proc.stop()


# ---------------------------------------------------------------- bad frames on the link

LINK_EXAMPLES = [
    encode(GenerateReq("g1", [1, 2, 3], SamplingParams(max_new_tokens=2, temperature=0))),
    encode(AbortReq("g1")),
    encode(ReplicaPing("fuzzer")),
]
bad_parts = st.one_of(
    st.lists(st.binary(max_size=48), min_size=2, max_size=3),  # not one frame
    st.binary(max_size=64).map(lambda b: [b]),
    values.map(lambda v: [msgpack.packb(v, use_bin_type=True)]),
    st.tuples(st.sampled_from(LINK_EXAMPLES), st.data()).map(lambda t: [_mutated(*t)]),
)


def _mutated(frame: bytes, data) -> bytes:
    body = msgpack.unpackb(frame, raw=False)
    key = data.draw(st.sampled_from(sorted(body)))
    return msgpack.packb(_mutate(body, key, data.draw(values), data.draw(st.booleans())))


class RawRouter:
    """A DEALER with the router's keys that sends whatever it is given."""

    def __init__(self, address: str, keys: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        curve.make_client(self.sock, f"{keys}/router.key_secret", f"{keys}/replica.key")
        self.sock.connect(address)

    def answers_until_status(self) -> list:
        """Ping, then every answer up to the ping's ReplicaStatus, decoded."""
        self.sock.send(encode(ReplicaPing("fuzzer")))
        answers = []
        while True:
            assert self.sock.poll(10_000), "the replica stopped answering"
            parts = self.sock.recv_multipart()
            if len(parts) == 1:
                answers.append(decode(parts[0], ROUTER_INBOX))
                continue
            assert parts[0] == REPLICA_CONTROL and len(parts) == 2
            msg = decode(parts[1], REPLICA_CONTROL_INBOX)
            if isinstance(msg, ReplicaStatus):
                return answers
            answers.append(msg)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def test_bad_frames_on_the_link_are_answered_and_never_fatal(keyed_replica, keys):
    router = RawRouter(keyed_replica.address, keys)
    try:
        router.answers_until_status()

        @settings(max_examples=80, deadline=None)
        @given(bad_parts)
        def check(parts):
            router.sock.send_multipart(parts)
            try:
                msg = decode(parts[0], REPLICA_INBOX) if len(parts) == 1 else None
            except ProtocolError:
                msg = None
            if isinstance(msg, GenerateReq):  # valid after all: do not let it run long
                router.sock.send(encode(AbortReq(msg.rid)))
            answers = router.answers_until_status()
            if msg is None:  # unusable: answered, as a request's error or the link's
                errors = (ReqError, ReplicaFrameError)
                if not any(isinstance(a, errors) for a in answers):
                    # a status the replica sent of itself (news of a change) came first
                    answers += router.answers_until_status()
                assert any(isinstance(a, errors) for a in answers)

        check()
        good = encode(GenerateReq("ok", [4, 5, 6], SamplingParams(max_new_tokens=3)))
        router.sock.send(good)
        outputs = []
        while not outputs or outputs[-1].finish_reason is None:
            outputs += [o for a in router.answers_until_status() if isinstance(a, TokenOutBatch)
                        for o in a.outputs if o.rid == "ok"]  # fmt: skip
    finally:
        router.close()
    assert keyed_replica.proc.poll() is None
    assert "Traceback" not in keyed_replica.log()


def test_bad_frames_from_a_replica_never_stop_the_router_link(tiny_model):
    """A fake replica (a bare ROUTER socket) sends garbage, then a valid status."""
    identity = model_identity(tiny_model)
    ready = SchedulerReady(64, 8, 512, "qwen3")
    garbage = [[b"x"], [REPLICA_CONTROL, b"\xc1"], [REPLICA_CONTROL, encode(ready)],
               [b"a", b"b", b"c"], [REPLICA_CONTROL, encode(ReplicaFrameError("?"))]]  # fmt: skip

    async def go():
        ctx = zmq.asyncio.Context()
        fake = ctx.socket(zmq.ROUTER)
        port = fake.bind_to_random_port("tcp://127.0.0.1")
        link = RemoteLink(f"tcp://127.0.0.1:{port}", identity, ServerArgs(model_path="m"), ctx)
        link.start()
        peer, _ping = await asyncio.wait_for(fake.recv_multipart(), 5)
        for parts in garbage:
            await fake.send_multipart([peer, *parts])
        status = ReplicaStatus(identity, "i1", "ready", "", ready)
        await fake.send_multipart([peer, REPLICA_CONTROL, encode(status)])
        frames = [await asyncio.wait_for(link.recv(), 5) for _ in range(2)]
        state = link.state
        link.close()
        ctx.destroy(linger=0)
        return frames, state

    frames, state = run(go())
    assert frames[0] == b"x"  # a scheduler frame: passed on for the manager to judge
    assert decode(frames[1], ROUTER_INBOX) == ready and state == "ready"


def test_a_frame_that_arrives_while_silence_is_checked_is_still_received(tiny_model):
    """The silence check reads the socket's EVENTS, which consumes the edge its asyncio
    reader waits for: a frame that arrived just before it must still be received (it was
    not, about half of the time, so a killed replica stayed ready)."""

    async def go():
        ctx = zmq.asyncio.Context()
        fake = ctx.socket(zmq.ROUTER)
        port = fake.bind_to_random_port("tcp://127.0.0.1")
        link = RemoteLink(f"tcp://127.0.0.1:{port}", model_identity(tiny_model),
                          ServerArgs(model_path="m"), ctx)  # fmt: skip
        while not await fake.poll(50):  # dropped until connected (IMMEDIATE)
            link.send_nowait(b"hello")
        peer, _ = await fake.recv_multipart()
        received = asyncio.create_task(link.recv())
        await asyncio.sleep(0)  # the reader waits on the socket now
        await fake.send_multipart([peer, b"x"])
        time.sleep(0.3)  # the frame lands while the loop does not run
        assert not link._silent(time.monotonic())  # waiting to be read: not silent
        try:
            return await asyncio.wait_for(received, 2)
        finally:
            link.close()
            ctx.destroy(linger=0)

    assert run(go()) == b"x"


def test_the_router_serves_on_from_a_remote_replica_once_its_local_one_is_given_up(
    keyed_replica, tiny_model, keys, tmp_path
):
    extra = [*POOL, "--dp-size", "1", "--max-restarts", "0", "--replica", keyed_replica.address,
             "--curve-secret-key", f"{keys}/router.key_secret",
             "--curve-server-key", f"{keys}/replica.key"]  # fmt: skip
    server = ServerProcess(tiny_model, tmp_path / "server.log", extra=extra)
    server.start()
    try:
        deadline = time.monotonic() + 60
        while _health(server.url)[1] != {"r0": "ready", "r1": "ready"}:
            assert time.monotonic() < deadline, _health(server.url)
            time.sleep(0.1)
        os.kill(server.child("worker"), signal.SIGKILL)  # --max-restarts 0: r0 is given up
        while "every local replica is given up" not in server.log():
            assert time.monotonic() < deadline + 60 and server.proc.poll() is None, server.log()
            time.sleep(0.1)
        assert _health(server.url) == (200, {"r0": "down", "r1": "ready"})
        prompt = [5, 9, 200, 17, 3, 88]
        body = {"prompt": prompt, "max_tokens": 5, "temperature": 0}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == mlx_greedy(tiny_model, prompt, 5)
        assert server.proc.poll() is None
    finally:
        server.stop()


def test_sigterm_drains_a_replica_its_router_routes_elsewhere_meanwhile(tiny_model, tmp_path):
    """SIGTERM to `radix-mlx replica`: the request it runs finishes, the router sees it
    `draining` and sends new requests to its local replica, then it exits 0 and is down."""
    replica = ReplicaProcess(tiny_model, tmp_path / "replica.log",
                             extra=[*POOL, "--graceful-shutdown-timeout", "120"])  # fmt: skip
    server = ServerProcess(tiny_model, tmp_path / "server.log", extra=[
        *POOL, "--dp-size", "1", "--replica", replica.address, "--routing-policy", "round_robin",
    ])  # fmt: skip
    with _stopping(replica):
        replica.start()
        server.start()
        try:
            _drain_while_serving(server, replica, tiny_model)
        finally:
            server.stop()


def _drain_while_serving(server: ServerProcess, replica: ReplicaProcess, model: str) -> None:
    deadline = time.monotonic() + 60
    while _health(server.url)[1] != {"r0": "ready", "r1": "ready"}:
        assert time.monotonic() < deadline, _health(server.url)
        time.sleep(0.1)
    body = {"prompt": [4, 8, 15, 16], "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    assert httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 1}).is_success
    thread, out = _post_in_thread(server.url, body)  # round robin: the second goes to r1
    wait_for(server.url, lambda m: m.get(PREFIX + 'num_running_requests{replica="r1"}') == 1,
             timeout=60, what="the long request running on r1")  # fmt: skip
    replica.proc.send_signal(signal.SIGTERM)
    while _health(server.url)[1]["r1"] != "draining":
        assert time.monotonic() < deadline + 60 and thread.is_alive(), _health(server.url)
        time.sleep(0.02)
    before = scrape(server.url)
    short = {**body, "max_tokens": 3}
    for _ in range(2):  # both to the local replica while r1 drains
        r = httpx.post(server.url + "/v1/completions", json=short, timeout=60)
        assert r.status_code == 200, r.text
    routed = PREFIX + 'replica_requests_total{replica="%s"}'
    after = scrape(server.url)
    assert delta(after, before, routed % "r0") == 2 and delta(after, before, routed % "r1") == 0
    thread.join(120)
    r = out["response"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == mlx_greedy(model, body["prompt"], 300)
    assert replica.proc.wait(60) == 0
    while _health(server.url)[1]["r1"] != "down":
        assert time.monotonic() < deadline + 120, _health(server.url)
        time.sleep(0.1)
