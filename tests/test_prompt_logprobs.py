"""Prompt logprobs (echo + logprobs, and max_tokens 0 as lm-evaluation-harness sends it)
equal log_softmax of mlx-lm's own logits within 1e-4, for a cold prompt and for one whose
prefix the radix cache holds: on the worker (ModelRunner) and through a real server with
the official `openai` SDK."""

from __future__ import annotations

import dataclasses
import math

import openai
import pytest

from common.messages import ReleaseReq, SamplingParams
from tests.conftest import load_model
from tests.test_model_runner import Harness

TOP = 3


def reference(path: str, ids: list[int]) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per prompt token after the first: its logprob and the TOP best, from mlx-lm."""
    import mlx.core as mx

    model, _ = load_model(path)
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    lp = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).tolist()
    out = []
    for i in range(len(ids) - 1):
        row = lp[i]
        best = sorted(range(len(row)), key=lambda t: -row[t])[:TOP]
        out.append((row[ids[i + 1]], [(t, row[t]) for t in best]))
    return out


def assert_close(got: list, want: list) -> None:
    assert len(got) == len(want)
    for (lp, top), (ref_lp, ref_top) in zip(got, want):
        assert abs(lp - ref_lp) < 1e-4
        assert [t for t, _ in top] == [t for t, _ in ref_top] or all(
            abs(v - rv) < 1e-4 for (_, v), (_, rv) in zip(top, ref_top)
        )  # a tie may order differently
        assert all(abs(v - rv) < 1e-4 for (_, v), (_, rv) in zip(top, ref_top))


def test_runner_cold_and_cached_prefix(tiny_model):
    h = Harness(tiny_model)
    asks = SamplingParams(temperature=0, max_new_tokens=2, prompt_logprobs=True, top_logprobs=TOP)
    prompt = [(13 * i + 5) % h.vocab for i in range(40)]
    cold = h.ereq("cold", prompt, sampling=asks)
    h.step += 1
    from common.messages import ExtendBatch

    out = h.runner.extend(ExtendBatch(h.step, [cold]))
    assert_close(out.prompt_logprobs[0], reference(tiny_model, prompt))
    h.runner.release([ReleaseReq("cold", True)])
    # a second prompt sharing the first 32 tokens, whose KV is in the pool: the worker only
    # gets the new tokens, and the prefix tokens as context (what the scheduler sends)
    longer = prompt[:32] + [7, 8, 9, 10, 11]
    warm = h.ereq("warm", longer[32:], prefix=h.prefix("cold", 32), sampling=asks)
    warm = dataclasses.replace(warm, context_ids=prompt[:32])
    plain = h.ereq("plain", [3, 4, 5], sampling=dataclasses.replace(asks, prompt_logprobs=False))
    out = h.runner.extend(ExtendBatch(h.step + 1, [plain, warm]))
    assert out.prompt_logprobs[0] is None
    assert_close(out.prompt_logprobs[1], reference(tiny_model, longer))


@pytest.fixture(scope="module")
def oai(tiny_server):
    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0) as client:
        yield client


def _check_choice(choice, ids: list[int], tiny_model: str, completion_tokens: int) -> None:
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    want = reference(tiny_model, ids)
    for i, (ref_lp, ref_top) in enumerate(want, start=1):
        assert abs(lp.token_logprobs[i] - ref_lp) < 1e-4
        # OpenAI's alternatives are keyed by text: tokens that spell the same text (half a
        # character is U+FFFD) share one entry, so each value is one of mlx-lm's best
        assert 1 <= len(lp.top_logprobs[i]) <= TOP
        for value in lp.top_logprobs[i].values():
            assert min(abs(value - v) for _, v in ref_top) < 1e-4


def test_echo_logprobs_max_tokens_0_cold_and_cached(oai, tiny_model):
    ids = [(17 * i + 3) % 500 + 3 for i in range(48)]
    cold = oai.completions.create(
        model="", prompt=ids, max_tokens=0, echo=True, logprobs=TOP, temperature=0
    )
    choice = cold.choices[0]
    assert cold.usage.completion_tokens == 0 and choice.finish_reason == "length"
    assert choice.text == load_model(tiny_model)[1].decode(ids)
    _check_choice(choice, ids, tiny_model, 0)
    # the same prefix again, longer: most of it comes from the radix cache
    longer = ids + [5, 6, 7, 8]
    warm = oai.completions.create(
        model="", prompt=longer, max_tokens=2, echo=True, logprobs=TOP, temperature=0
    )
    assert warm.usage.prompt_tokens_details.cached_tokens >= len(ids) - 1
    assert warm.usage.completion_tokens == 2
    _check_choice(warm.choices[0], longer, tiny_model, 2)
    gen = warm.choices[0].logprobs.token_logprobs[-2:]
    assert all(isinstance(x, float) and x <= 0 and math.isfinite(x) for x in gen)


def test_max_tokens_0_needs_echo(oai):
    with pytest.raises(openai.BadRequestError, match="echo"):
        oai.completions.create(model="", prompt="hi", max_tokens=0)


@pytest.mark.parametrize("ids", [[-1], [10**6]])
def test_echo_of_out_of_range_ids_is_a_400(oai, ids):
    # found by the schemathesis run: echo decoded the ids before they were checked (a 500)
    with pytest.raises(openai.BadRequestError, match="must be in"):
        oai.completions.create(model="", prompt=ids, echo=True, max_tokens=1)
