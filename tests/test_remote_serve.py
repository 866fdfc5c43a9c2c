"""`radix-mlx serve --replica` end to end: deploy/local-replicas.sh (two keyed replicas on
loopback tcp and a router with --dp-size 0), plus a third replica of another model that
the router must refuse.

Where a request landed is read from `radix_mlx_replica_requests_total{replica}` around it
(requests are sent one at a time). The kill test runs last.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest

from common.ipc import free_ports
from common.server_process import ServerProcess
from tests.conftest import mlx_greedy
from tests.server import RADIX_MLX, ReplicaProcess
from tests.test_faults import _body
from tests.test_metrics import PREFIX, scrape

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "local-replicas.sh"
POOL = "--max-total-tokens 4096"
IDS = ("r0", "r1", "r2")  # the script's two replicas, then the other model's


def _two_free_ports() -> int:
    """A port p with p + 1 free too (the script listens on both)."""
    for _ in range(50):
        (port,) = free_ports(1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two consecutive free ports")


class Example(ServerProcess):
    """The script; ready once the router lists its two replicas ready."""

    def ready(self) -> bool:
        try:
            states = _states(self.url)
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        return states["r0"] == states["r1"] == "ready" and states["r2"] != "starting"


def _states(url: str) -> dict[str, str]:
    return {r["id"]: r["state"] for r in httpx.get(url + "/health", timeout=5).json()["replicas"]}


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("keys") / "k"
    subprocess.run([RADIX_MLX, "keys", "--out", str(out)], check=True, capture_output=True)
    return str(out)


@pytest.fixture(scope="module")
def other_model(tiny_llama, keys, tmp_path_factory):
    log = tmp_path_factory.mktemp("other") / "replica.log"
    extra = ["--max-total-tokens", "1024", "--curve-secret-key", f"{keys}/replica.key_secret",
             "--curve-authorized-keys", f"{keys}/authorized"]  # fmt: skip
    replica = ReplicaProcess(tiny_llama, log, extra=extra)
    replica.READY = "listening on"  # it reports its identity from then on: enough to refuse
    replica.start()
    yield replica
    replica.stop()


@pytest.fixture(scope="module")
def example(tiny_model, keys, other_model, tmp_path_factory):
    port, rport = free_ports(1)[0], _two_free_ports()
    env = dict(os.environ, HF_HUB_OFFLINE="1", RADIX_MLX=RADIX_MLX, KEYS=keys,
               REPLICA_ARGS=POOL, ROUTER_ARGS=f"--replica {other_model.address}")  # fmt: skip
    log = tmp_path_factory.mktemp("example") / "example.log"
    cmd = ["bash", str(SCRIPT), tiny_model, str(port), str(rport)]
    proc = Example(cmd, f"http://127.0.0.1:{port}", log, env)
    proc.rport = rport
    proc.start(timeout=180)
    yield proc
    assert proc.stop() == 0
    assert "Traceback" not in proc.log()


def _routed(url: str) -> dict[str, float]:
    m = scrape(url)
    key = PREFIX + 'replica_requests_total{replica="%s"}'
    return {r: m.get(key % r, 0.0) for r in IDS}


def _complete(url: str, prompt: list[int], n: int) -> tuple[str, list[int]]:
    """(the replica it landed on, token ids) of one greedy completion."""
    before = _routed(url)
    r = httpx.post(url + "/v1/completions", json=_body(prompt, n), timeout=60)
    assert r.status_code == 200, r.text
    after = _routed(url)
    (landed,) = [rid for rid in IDS if after[rid] != before[rid]]
    return landed, r.json()["choices"][0]["token_ids"]


def test_health_lists_the_remote_replicas_and_refuses_the_other_model(example, other_model):
    r = httpx.get(example.url + "/health", timeout=5)
    assert r.status_code == 200
    replicas = r.json()["replicas"]
    assert [rep["address"] for rep in replicas] == [
        f"tcp://127.0.0.1:{example.rport}",
        f"tcp://127.0.0.1:{example.rport + 1}",
        other_model.address,
    ]
    assert [rep["state"] for rep in replicas] == ["ready", "ready", "refused"]
    refusals = [line for line in example.log().splitlines() if "refusing replica" in line]
    assert len(refusals) == 1 and other_model.address in refusals[0]
    assert "another model: it serves model_type llama" in refusals[0]


def test_greedy_tokens_match_mlx_lm_and_conversations_stick(example, tiny_model):
    system = [[(7 * g + i) % 500 + 3 for i in range(48)] for g in range(2)]
    landed: dict[int, set[str]] = {0: set(), 1: set()}
    for turn in range(3):
        for g in (0, 1):
            prompt = system[g] + [11 + turn, 12 + g, 13 + turn]
            replica, tokens = _complete(example.url, prompt, 8)
            assert tokens == mlx_greedy(tiny_model, prompt, 8)
            landed[g].add(replica)
    assert all(len(replicas) == 1 for replicas in landed.values()), landed
    assert landed[0] | landed[1] <= {"r0", "r1"}


def _replica_pid(example: Example, port: int) -> int:
    for proc in psutil.Process(example.proc.pid).children(recursive=True):
        try:
            if any(c.laddr.port == port and c.status == "LISTEN" for c in proc.net_connections()):
                return proc.pid
        except psutil.Error:
            continue
    raise AssertionError(f"no replica listens on {port}")


def test_a_killed_replica_is_out_within_2_s_the_other_serves_and_it_rejoins(example, tiny_model):
    os.kill(_replica_pid(example, example.rport), signal.SIGKILL)
    killed = time.monotonic()
    # out: down, or already starting when the script's restart answers at once (the
    # router's "down" then lasts only until that answer)
    while _states(example.url)["r0"] == "ready":
        assert time.monotonic() - killed < 5, _states(example.url)
        time.sleep(0.05)
    assert time.monotonic() - killed < 2.0  # the bound
    prompt = [5, 9, 200, 31, 4]
    assert _complete(example.url, prompt, 6) == ("r1", mlx_greedy(tiny_model, prompt, 6))
    deadline = time.monotonic() + 60  # the script starts it again, as launchd would
    while _states(example.url)["r0"] != "ready":
        assert time.monotonic() < deadline, _states(example.url)
        time.sleep(0.2)
    assert f"replica tcp://127.0.0.1:{example.rport} is down" in example.log()
