"""N-gram speculative decoding through a real server: greedy output stays mlx-lm's.

One server with speculation, a pool small enough to evict and retract, and
--debug-invariants (so every rejected draft's slot is accounted for after each step),
serves batches that mix rows whose drafts are accepted with rows whose drafts fail,
across cached prefixes and turns. The default tiny models are tuned never to loop, so
n-gram drafts would all fail on them; the model here is the tiny one built with `loop`
(its greedy output cycles after a while), and its rows are in their tail (drafts fail)
or their cycle (drafts hold) at different times.
"""

from __future__ import annotations

import concurrent.futures
import random
import re

import httpx
import pytest

from tests.conftest import mlx_greedy
from tests.server import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loop_model(model_cache) -> str:
    from common.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model(model_cache, preset="tiny", loop=True))


@pytest.fixture(scope="module")
def spec_server(loop_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("spec") / "server.log"
    server = ServerProcess(
        loop_model,
        log,
        extra=[
            "--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "5",
            "--max-total-tokens", "600", "--debug-invariants", "--decode-log-interval", "5",
        ],
    )  # fmt: skip
    server.start()
    yield server
    server.stop()


def _complete(url: str, body: dict) -> dict:
    base = {"temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=base | body, timeout=300).json()


def _mixed_load(seed: int) -> list[tuple[list[int], int]]:
    """Prompts that repeat a phrase (their drafts match), random ones, and ones sharing a
    prefix with each other."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 512) for _ in range(24)]
    load = []
    for i in range(10):
        phrase = [rng.randrange(3, 512) for _ in range(rng.randrange(3, 9))]
        if i % 3 == 0:
            prompt = phrase * rng.randrange(3, 7)
        elif i % 3 == 1:
            prompt = shared + [rng.randrange(3, 512) for _ in range(rng.randrange(2, 20))]
        else:
            prompt = [rng.randrange(3, 512) for _ in range(rng.randrange(5, 40))]
        load.append((prompt, rng.randrange(20, 70)))
    return load


def test_batched_speculation_matches_mlx_lm(spec_server, loop_model):
    for seed in range(2):
        load = _mixed_load(seed)

        def run(item, url=spec_server.url):
            prompt, n = item
            return _complete(url, {"prompt": prompt, "max_tokens": n})

        with concurrent.futures.ThreadPoolExecutor(len(load)) as pool:
            results = list(pool.map(run, load))
        for (prompt, n), res in zip(load, results):
            assert "choices" in res, res
            assert res["choices"][0]["token_ids"] == mlx_greedy(loop_model, prompt, n)
            assert res["usage"]["completion_tokens"] == n
    log = spec_server.log()
    assert "Traceback" not in log and "two owners" not in log and "slots lost" not in log
    accept = [float(x) for x in re.findall(r"accept len: ([0-9.]+)", log)]
    assert accept and max(accept) > 1.5, accept  # drafts were accepted, not just sent


def test_turns_reuse_the_cache_with_speculation(spec_server, loop_model):
    rng = random.Random(7)
    history = [rng.randrange(3, 512) for _ in range(6)] * 4
    for _ in range(3):
        res = _complete(spec_server.url, {"prompt": history, "max_tokens": 30})
        out = res["choices"][0]["token_ids"]
        assert out == mlx_greedy(loop_model, history, 30)
        history = history + out + [rng.randrange(3, 512) for _ in range(3)]
    assert res["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_stops_inside_an_accepted_run_truncate_as_without_speculation(spec_server, loop_model):
    prompt = [11, 12, 13, 14] * 6
    want = mlx_greedy(loop_model, prompt, 40)
    stop = want[9]  # a stop token that a draft run may well contain
    res = _complete(spec_server.url, {"prompt": prompt, "max_tokens": 40, "ignore_eos": False,
                                      "stop_token_ids": [stop]})  # fmt: skip
    got = res["choices"][0]["token_ids"]
    assert got == want[: want.index(stop) + 1]
    res = _complete(spec_server.url, {"prompt": prompt, "max_tokens": 7})
    assert res["choices"][0]["token_ids"] == want[:7]


def test_seeded_sampling_with_speculation_is_reproducible(spec_server):
    prompt = [21, 22, 23, 24, 25] * 5
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0.7, "seed": 5}
    first = _complete(spec_server.url, body)["choices"][0]["token_ids"]
    again = _complete(spec_server.url, body)["choices"][0]["token_ids"]
    assert first == again and len(first) == 40
    other = _complete(spec_server.url, body | {"seed": 6})["choices"][0]["token_ids"]
    assert other != first


def _stop_token(tokenizer, tokens: list[int], stop: str) -> int:
    """How many tokens the router takes to see `stop` when they come one by one, as
    they do without speculation."""
    from router.api.detokenizer import IncrementalDetokenizer
    from router.api.generation import StopMatcher

    detok, matcher = IncrementalDetokenizer(tokenizer), StopMatcher([stop])
    for j, tok in enumerate(tokens):
        if matcher.feed(detok.add([tok]), final=False)[1]:
            return j + 1
    raise AssertionError(f"{stop!r} not in the output")


def test_stop_strings_inside_an_accepted_run_end_at_their_token(spec_server, loop_model):
    from tests.conftest import load_model

    _, tokenizer = load_model(loop_model)
    cycle = mlx_greedy(loop_model, [31, 32, 33] * 8, 60)[30:]  # the output's loop
    prompt = cycle * 2  # the output continues it, and every draft is accepted
    want = mlx_greedy(loop_model, prompt, 30)
    text = tokenizer.decode(want)
    for at in range(1, 16, 2):
        stop = text[at : at + 2]
        ends = _stop_token(tokenizer, want, stop)
        res = _complete(spec_server.url, {"prompt": prompt, "max_tokens": 30, "stop": [stop]})
        choice = res["choices"][0]
        assert choice["text"] == text[: text.index(stop)] and choice["finish_reason"] == "stop"
        assert res["usage"]["completion_tokens"] == ends
