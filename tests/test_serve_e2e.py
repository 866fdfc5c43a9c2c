"""End to end: a real `radix-mlx serve` against mlx-lm's own greedy generation."""

from __future__ import annotations

import concurrent.futures
import os
import random
import re
import signal
import subprocess
import time

import httpx
import pytest
import zmq

from benchmarks.sse import iter_sse_data
from common.messages import ClientGenerate, SamplingParams
from common.protocol import encode
from router.client import Client, RadixMLXError
from tests.conftest import load_model, mlx_greedy
from tests.server import RADIX_MLX, ServerProcess, exited

pytestmark = pytest.mark.slow


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(4, 60))] for _ in range(n)]


def _complete(server: ServerProcess, prompt, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_token_id_prompts_match_mlx_lm(tiny_server, tiny_model):
    for prompt in _prompts(4):
        got = _complete(tiny_server, prompt, 12)["choices"][0]["token_ids"]
        assert got == mlx_greedy(tiny_model, prompt, 12)


def test_concurrent_requests_match_mlx_lm(tiny_server, tiny_model):
    prompts = _prompts(6, seed=1)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda p: _complete(tiny_server, p, 10), prompts))
    for prompt, res in zip(prompts, results):
        assert res["choices"][0]["token_ids"] == mlx_greedy(tiny_model, prompt, 10)


def test_text_prompt_and_repeated_prompt_hits_cache(parity_server):
    server, model = parity_server  # with and without a tokenizer that adds a BOS
    _, tokenizer = load_model(model)
    text = "The quick brown fox jumps over the lazy dog, again and again."
    ids = tokenizer.encode(text)  # as mlx_lm.server encodes a completion's text
    first = _complete(server, text, 8)
    second = _complete(server, text, 8)
    expected = mlx_greedy(model, ids, 8)
    assert first["choices"][0]["token_ids"] == expected
    assert second["choices"][0]["token_ids"] == expected
    assert second["usage"]["prompt_tokens"] == len(ids)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1
    assert f"#new-token: 1, #cached-token: {len(ids) - 1}" in server.log()


def test_sdk_generate_matches_mlx_lm(tiny_server, tiny_model):
    prompt = _prompts(1, seed=2)[0]
    with Client(tiny_server.zmq_address, timeout=60) as client:
        res = client.generate(input_ids=prompt, max_new_tokens=9, temperature=0, ignore_eos=True)
        streamed = [
            t
            for chunk in client.stream(
                input_ids=prompt, max_new_tokens=9, temperature=0, ignore_eos=True
            )
            for t in chunk.token_ids
        ]
    expected = mlx_greedy(tiny_model, prompt, 9)
    assert res.output_ids == expected
    assert streamed == expected
    assert res.finish_reason == "length"
    assert res.usage.prompt_tokens == len(prompt)
    assert res.usage.completion_tokens == 9


def test_bad_http_bodies_get_openai_errors(tiny_server):
    url = tiny_server.url + "/v1/completions"
    cases = [
        (b"{not json", "malformed JSON"),
        (b'{"prompt": "hi", "max_tokens": "many"}', "max_tokens"),
        (b'{"prompt": "hi", "temperature": -1}', "temperature"),
        (b'{"prompt": [1, 2, 99999]}', "token ids"),
        (b'{"prompt": "hi", "model": "no-such-model"}', "does not exist"),
        (b'{"prompt": [%s5]}' % (b"5, " * 8191), "context length"),  # no room left in the pool
    ]
    for body, needle in cases:
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        err = r.json()["error"]
        assert needle in err["message"], (body, err)
        assert {"message", "type", "code"} <= set(err)
    assert _complete(tiny_server, [5, 6, 7], 2)["choices"][0]["finish_reason"] == "length"


def test_garbage_zmq_frames_get_errors_and_server_keeps_serving(tiny_server, tiny_model):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(tiny_server.zmq_address)
    try:
        for frame in [b"\xc1garbage", encode(SamplingParams()), b"\x93\x01\x02\x03"]:
            sock.send(frame)
            assert sock.poll(10_000), "no answer to a bad frame"
            reply = sock.recv()
            assert b"ClientError" in reply and b"bad frame" in reply
        bad = ClientGenerate(rid="x", sampling=SamplingParams(max_new_tokens=2), text=None)
        sock.send(encode(bad))
        assert sock.poll(10_000)
        assert b"exactly one of" in sock.recv()
    finally:
        ctx.destroy(linger=0)
    prompt = [9, 8, 7, 6]
    assert _complete(tiny_server, prompt, 4)["choices"][0]["token_ids"] == mlx_greedy(
        tiny_model, prompt, 4
    )


def test_server_side_error_reaches_sdk_as_exception(tiny_server):
    with Client(tiny_server.zmq_address, timeout=30) as client:
        with pytest.raises(RadixMLXError, match="context length"):
            client.generate(input_ids=[1, 2, 3], max_new_tokens=10**6)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_shutdown_leaves_no_child_and_no_socket(tiny_model, tmp_path, sig):
    server = ServerProcess(tiny_model, tmp_path / "log", extra=["--max-total-tokens", "512"])
    server.start()
    ours = re.search(r"runtime directory (\S+)", server.log())[1]  # others may run servers
    assert os.path.isdir(ours)
    children = server.children()
    assert len(children) >= 2
    started = time.monotonic()
    server.stop(sig)
    assert time.monotonic() - started < 10
    assert server.proc.returncode == 0, server.log()
    assert exited(children, 5)
    assert not os.path.exists(ours)


def test_killed_worker_with_no_restarts_left_exits_nonzero(tiny_model, tmp_path):
    extra = ["--max-total-tokens", "4096", "--max-restarts", "0"]
    server = ServerProcess(tiny_model, tmp_path / "log", extra=extra)
    server.start()
    body = {"prompt": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        events = iter_sse_data(r)
        assert next(events).startswith("{")
        os.kill(server.child("worker"), signal.SIGKILL)
        events = list(events)
    assert events[-1] == "[DONE]"
    assert "worker process exited with status -9 (SIGKILL)" in events[-2], events[-2:]
    server.proc.wait(15)
    assert server.proc.returncode not in (0, None)
    assert "giving up: worker process exited with status -9 (SIGKILL)" in server.log()
    server.stop()


def test_missing_model_path_fails_with_one_clear_line(tmp_path):
    missing = tmp_path / "no-such-model"
    out = subprocess.run(
        [RADIX_MLX, "serve", "--model-path", str(missing), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if "model" in line.lower()]
    assert any(f"--model-path {missing}: no such model directory" in line for line in lines)


def test_tcp_transport_serves_exact_tokens(tiny_model, tmp_path):
    server = ServerProcess(
        tiny_model, tmp_path / "log", extra=["--max-total-tokens", "512", "--transport", "tcp"]
    )
    server.start()
    try:
        prompt = _prompts(1, seed=5)[0]
        assert _complete(server, prompt, 6)["choices"][0]["token_ids"] == mlx_greedy(
            tiny_model, prompt, 6
        )
    finally:
        assert server.stop() == 0


def test_overload_gets_503_and_others_keep_going(tiny_model, tmp_path):
    server = ServerProcess(
        tiny_model,
        tmp_path / "log",
        extra=["--max-total-tokens", "30000", "--max-queued-requests", "2"],
    )
    server.start()
    # long enough that both stay in flight while the third arrives; closing aborts them
    body = {"prompt": [5, 6, 7], "max_tokens": 14000, "ignore_eos": True, "stream": True}
    url = server.url + "/v1/completions"
    try:
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", url, json=body) as a, http.stream("POST", url, json=body) as b:
                assert a.status_code == 200 and b.status_code == 200
                lines = [a.iter_lines(), b.iter_lines()]  # dropping them would disconnect
                assert all(next(it).startswith("data: ") for it in lines)
                r = httpx.post(url, json={"prompt": "hi", "max_tokens": 2})
                assert r.status_code == 503
                assert "overloaded" in r.json()["error"]["message"]
        # the closed streams are aborted once the server notices the disconnects
        deadline = time.monotonic() + 10
        while (r := httpx.post(url, json={"prompt": [9, 9], "max_tokens": 3})).status_code == 503:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.1)
        assert r.json()["choices"][0]["finish_reason"] == "length"
    finally:
        assert server.stop() == 0
