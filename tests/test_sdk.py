"""The ZMQ SDK (`radix_mlx`, also `router.client`) against a real server: sync and async
calls, streaming, abort, timeouts, typed errors, many concurrent clients, and clients
that vanish."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from common.messages import ClientGenerate, SamplingParams
from common.protocol import encode
from router.client import AsyncClient, Client, RadixMLXError, RequestTimeout
from tests.conftest import load_model, mlx_greedy
from tests.test_metrics import PREFIX, delta, scrape, wait_idle, wait_running

pytestmark = pytest.mark.slow

ABORTS = PREFIX + 'requests_total{finish_reason="abort"}'
GREEDY = {"temperature": 0, "ignore_eos": True}
ROOT = Path(__file__).resolve().parents[1]


def _prompt(seed: int, n: int | None = None) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n or rng.randrange(4, 40))]


def _chat_ids(tiny_model, messages) -> list[int]:
    tokenizer = load_model(tiny_model)[1]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_sync_generate_stream_and_chat(tiny_server, tiny_model):
    tokenizer = load_model(tiny_model)[1]
    prompt = _prompt(1)
    expected = mlx_greedy(tiny_model, prompt, 12)
    messages = [{"role": "user", "content": "Bonjour, ça va ? 日本語"}]
    with Client(tiny_server.zmq_address, timeout=60) as client:
        res = client.generate(input_ids=prompt, max_new_tokens=12, **GREEDY)
        chunks = list(client.stream(input_ids=prompt, max_new_tokens=12, **GREEDY))
        again = client.generate(input_ids=prompt, max_new_tokens=12, **GREEDY)
        chat = client.chat(messages, max_new_tokens=6, **GREEDY)
        by_text = client.generate("The capital of France is", max_new_tokens=5, **GREEDY)
        parts = [{"type": "text", "text": m["content"]} for m in messages]
        chat_parts = client.chat([{"role": "user", "content": parts}], max_new_tokens=6, **GREEDY)
        favoured = client.generate(
            input_ids=prompt, max_new_tokens=3, logit_bias={300: 100}, **GREEDY
        )
    assert res.output_ids == expected
    assert res.text == tokenizer.decode(expected)
    assert res.finish_reason == "length"
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (len(prompt), 12)
    assert [t for c in chunks for t in c.token_ids] == expected
    assert "".join(c.text for c in chunks) == res.text
    assert [c.finish_reason for c in chunks][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12
    assert again.usage.cached_tokens == len(prompt) - 1
    chat_ids = _chat_ids(tiny_model, messages)
    assert chat.output_ids == mlx_greedy(tiny_model, chat_ids, 6)
    assert chat.usage.prompt_tokens == len(chat_ids)
    text_ids = tokenizer.encode("The capital of France is", add_special_tokens=False)
    assert by_text.output_ids == mlx_greedy(tiny_model, text_ids, 5)
    assert chat_parts.output_ids == chat.output_ids
    assert favoured.output_ids == [300] * 3  # the SDK's int keys work like the API's strings


def test_logprobs_through_the_sdk_match_the_http_api(tiny_server):
    import httpx

    prompt = _prompt(3)
    params = dict(max_new_tokens=6, logprobs=True, top_logprobs=3, **GREEDY)
    with Client(tiny_server.zmq_address, timeout=60) as client:
        res = client.generate(input_ids=prompt, **params)
        chunks = list(client.stream(input_ids=prompt, **params))
        plain = client.generate(input_ids=prompt, max_new_tokens=6, **GREEDY)
    assert plain.logprobs is None and plain.top_logprobs is None
    assert len(res.logprobs) == len(res.top_logprobs) == 6
    for tok, lp, top in zip(res.output_ids, res.logprobs, res.top_logprobs):
        assert lp <= 0 and len(top) == 3
        assert top[0] == [tok, pytest.approx(lp)]  # greedy picked the best
    # later runs reuse the cached prompt: the same logprobs to float rounding
    assert [x for c in chunks for x in c.logprobs] == pytest.approx(res.logprobs, abs=1e-4)
    top_ids = [[alt[0] for alt in top] for top in res.top_logprobs]
    assert [[alt[0] for alt in top] for c in chunks for top in c.top_logprobs] == top_ids
    body = httpx.post(
        tiny_server.url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 3},
        timeout=60,
    ).json()
    assert body["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(res.logprobs, abs=1e-4)


def test_async_generate_stream_chat_and_abort(tiny_server, tiny_model):
    prompt = _prompt(2)
    expected = mlx_greedy(tiny_model, prompt, 10)
    messages = [{"role": "user", "content": "hello"}]

    async def main():
        async with AsyncClient(tiny_server.zmq_address, timeout=60) as client:
            res = await client.generate(input_ids=prompt, max_new_tokens=10, **GREEDY)
            streamed = [
                c async for c in client.stream(input_ids=prompt, max_new_tokens=10, **GREEDY)
            ]
            chat = await client.chat(messages, max_new_tokens=4, **GREEDY)
            # abort a running non-streaming request from another task
            job = asyncio.create_task(
                client.generate(input_ids=_prompt(3), rid="long", max_new_tokens=4000, **GREEDY)
            )
            await asyncio.sleep(0.3)
            await client.abort("long")
            aborted = await asyncio.wait_for(job, 10)
            return res, streamed, chat, aborted

    res, streamed, chat, aborted = asyncio.run(main())
    assert res.output_ids == expected and res.finish_reason == "length"
    assert [t for c in streamed for t in c.token_ids] == expected
    assert "".join(c.text for c in streamed) == res.text
    assert chat.output_ids == mlx_greedy(tiny_model, _chat_ids(tiny_model, messages), 4)
    assert aborted.finish_reason == "abort"
    assert aborted.rid == "long"
    assert 0 < len(aborted.output_ids) < 4000
    assert aborted.usage.completion_tokens == len(aborted.output_ids)
    wait_idle(tiny_server.url)


def test_sync_abort_and_early_close_free_slots(tiny_server):
    url = tiny_server.url
    wait_idle(url)
    before = scrape(url)
    with Client(tiny_server.zmq_address, timeout=30) as client:
        # abort() mid-stream: the stream ends with finish_reason "abort"
        chunks = []
        for chunk in client.stream(input_ids=_prompt(4), max_new_tokens=4000, **GREEDY):
            chunks.append(chunk)
            if len(chunks) == 3:
                wait_running(url)
                client.abort(chunk.rid)
        assert chunks[-1].finish_reason == "abort"
        assert sum(len(c.token_ids) for c in chunks) < 4000
        wait_idle(url)
        # closing the iterator early aborts too
        stream = client.stream(input_ids=_prompt(5), max_new_tokens=4000, **GREEDY)
        next(stream)
        wait_running(url)
        stream.close()
        wait_idle(url)
        # and the client keeps working afterwards
        res = client.generate(input_ids=[5, 6, 7], max_new_tokens=3, **GREEDY)
        assert res.finish_reason == "length" and len(res.output_ids) == 3
    after = scrape(url)
    assert delta(after, before, ABORTS) == 2


def test_timeouts_raise_and_abort(tiny_server):
    url = tiny_server.url
    with Client(tiny_server.zmq_address, timeout=30) as client:
        with pytest.raises(RequestTimeout) as info:
            client.generate(input_ids=_prompt(6), max_new_tokens=4000, timeout=0.3, **GREEDY)
        assert isinstance(info.value, TimeoutError) and info.value.code == "timeout"
        wait_idle(url)
        # a late answer to the timed-out request is never mistaken for this one
        res = client.generate(input_ids=[8, 9], max_new_tokens=2, **GREEDY)
        assert len(res.output_ids) == 2

    async def main():
        async with AsyncClient(tiny_server.zmq_address, timeout=0.3) as client:
            with pytest.raises(RequestTimeout):
                await client.generate(input_ids=_prompt(7), max_new_tokens=4000, **GREEDY)

    asyncio.run(main())
    wait_idle(url)


def test_server_errors_are_typed_exceptions_with_the_servers_message(tiny_server):
    with Client(tiny_server.zmq_address, timeout=30) as client:
        cases = [
            (dict(input_ids=[1, 2, 3], max_new_tokens=10**6), "maximum context length", 400),
            (dict(input_ids=[1, 2, 100000]), "prompt token ids must be in [0, 512)", 400),
            (dict(input_ids=[]), "the prompt is empty", 400),
            (dict(input_ids=[1, 2], temperature=-1.0), "temperature must be >= 0", 400),
            (dict(input_ids=[1, 2], top_p=0.0), "top_p must be in (0, 1]", 400),
        ]
        for kwargs, needle, status in cases:
            with pytest.raises(RadixMLXError) as info:
                client.generate(**kwargs)
            assert needle in info.value.message, kwargs
            assert str(info.value) == info.value.message
            assert info.value.status == status
        with pytest.raises(RadixMLXError, match="context length") as info:
            list(client.stream(input_ids=[1, 2, 3], max_new_tokens=10**6))
        assert info.value.code == "context_length_exceeded"
        with pytest.raises(TypeError, match="unknown sampling parameters"):
            client.generate("hi", temprature=0)

    async def main():
        async with AsyncClient(tiny_server.zmq_address, timeout=30) as client:
            with pytest.raises(RadixMLXError, match="stop_token_ids must be in"):
                await client.generate(input_ids=[1, 2], stop_token_ids=[9999])

    asyncio.run(main())


def test_many_concurrent_async_clients_are_all_served_exactly(tiny_server, tiny_model):
    prompts = [_prompt(100 + i) for i in range(16)]
    lengths = [6 + i % 7 for i in range(16)]

    async def main():
        clients = [AsyncClient(tiny_server.zmq_address, timeout=120) for _ in range(4)]
        try:
            jobs = []
            for i, (prompt, n) in enumerate(zip(prompts, lengths)):
                client = clients[i % 4]
                if i % 2:
                    jobs.append(client.generate(input_ids=prompt, max_new_tokens=n, **GREEDY))
                else:
                    jobs.append(_collect(client, prompt, n))
            return await asyncio.gather(*jobs)
        finally:
            for c in clients:
                await c.close()

    results = asyncio.run(main())
    for prompt, n, res in zip(prompts, lengths, results):
        ids = res if isinstance(res, list) else res.output_ids
        assert ids == mlx_greedy(tiny_model, prompt, n)


async def _collect(client: AsyncClient, prompt, n) -> list[int]:
    return [
        t
        async for c in client.stream(input_ids=prompt, max_new_tokens=n, **GREEDY)
        for t in c.token_ids
    ]


def test_vanished_clients_do_not_leak_requests(tiny_server):
    url = tiny_server.url
    wait_idle(url)
    before = scrape(url)
    # A raw client that sends a long non-streaming request and closes its socket.
    for stream in (False, True):
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(tiny_server.zmq_address)
        sampling = SamplingParams(max_new_tokens=4000, temperature=0, ignore_eos=True)
        sock.send(
            encode(ClientGenerate(f"v{stream}", sampling, input_ids=_prompt(8), stream=stream))
        )
        wait_running(url)
        ctx.destroy(linger=0)
        wait_idle(url)

    # An SDK client process killed while it waits for a long answer.
    code = (
        "import sys; from router.client import Client\n"
        "c = Client(sys.argv[1]); print('sending', flush=True)\n"
        "c.generate(input_ids=[5, 6, 7], max_new_tokens=4000, temperature=0, ignore_eos=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, tiny_server.zmq_address], stdout=subprocess.PIPE, cwd=ROOT
    )
    try:
        assert proc.stdout.readline() == b"sending\n"
        wait_running(url)
    finally:
        proc.kill()
        proc.wait()
    wait_idle(url)
    after = scrape(url)
    assert delta(after, before, ABORTS) == 3
    assert "SDK client disconnected" in tiny_server.log()

    # An AsyncClient closed with requests in flight: they fail, the server aborts them.
    async def main():
        client = AsyncClient(tiny_server.zmq_address, timeout=30)
        jobs = [
            asyncio.create_task(
                client.generate(input_ids=_prompt(10 + i), max_new_tokens=4000, **GREEDY)
            )
            for i in range(3)
        ]
        await asyncio.sleep(0.5)
        await client.close()
        return await asyncio.gather(*jobs, return_exceptions=True)

    outcomes = asyncio.run(main())
    assert all(isinstance(o, RadixMLXError) and o.code == "closed" for o in outcomes), outcomes
    wait_idle(url)
