"""The worker's speculative verify step, driven through the slot contract.

The in-test scheduler (tests/test_model_runner.py's Harness) sends decode descriptors with
drafts: mlx-lm's own continuation, some of it corrupted, of random lengths, so rows in
one step accept different numbers of drafts and leave holes of different sizes in the
decode buffer. Rejected drafts' slots go straight back to the allocator (most recently
freed first), so the next step reuses them. Greedy output must stay mlx-lm's, and the
pool must hold exactly the KV of the accepted tokens.
"""

from __future__ import annotations

import random

import pytest

from common.messages import DecodeBatch, ReleaseReq, SamplingParams
from tests.test_model_runner import Harness, greedy, random_prompt, reference


def verify_decode(h: Harness, drafts: dict[str, list[int]]):
    """One decode step of every running request with `drafts` (rid -> tokens)."""
    rids = list(h.running)
    locs = h.alloc.alloc(len(rids))
    dl = [h.alloc.alloc(len(drafts.get(rid, []))) for rid in rids]
    h.step += 1
    batch = DecodeBatch(
        h.step, rids, locs, drafts=[drafts.get(rid, []) for rid in rids], draft_slots=dl
    )
    res = h.worker.decode(batch)
    assert res.rids == rids
    for i, rid in enumerate(rids):
        d, a = batch.drafts[i], res.accepted[i] if res.accepted else 0
        assert 0 <= a <= len(d)
        h.slots[rid] += [locs[i]] + dl[i][:a]
        h.tokens[rid] += [h.out[rid][-1]] + d[:a]
        h.out[rid] += d[:a] + [res.next_token_ids[i]]
        h.alloc.free(dl[i][a:][::-1])
    return res


@pytest.fixture(params=["tiny_model", "tiny_llama"])
def model_path(request) -> str:
    return request.getfixturevalue(request.param)


def _drafts_from(h: Harness, want: dict[str, list[int]], rng: random.Random) -> dict:
    """Per running request, the next tokens of `want`, of random length, sometimes with
    one token wrong."""
    out = {}
    for rid in h.running:
        n = len(h.out[rid])
        d = want[rid][n : n + rng.randint(0, 5)]
        if d and rng.random() < 0.4:
            d[rng.randrange(len(d))] = (d[0] + 1) % h.vocab
        out[rid] = d
    return out


@pytest.mark.parametrize("compile_decode", [True, False], ids=["compiled", "eager"])
def test_verify_steps_with_mixed_acceptance_match_mlx_lm(model_path, compile_decode):
    h = Harness(model_path, compile_decode=compile_decode)
    rng = random.Random(3)
    prompts = {f"r{i}": random_prompt(rng, rng.randint(1, 50), h.vocab) for i in range(4)}
    prompts["late"] = random_prompt(rng, 30, h.vocab)
    want = {rid: reference(h.path, p, 40) for rid, p in prompts.items()}
    h.extend([h.ereq(rid, prompts[rid], sampling=greedy(64)) for rid in list(prompts)[:4]])
    accepted = 0
    for step in range(16):
        if step == 5:  # a request joins a buffer with holes
            h.extend([h.ereq("late", prompts["late"], sampling=greedy(64))])
        drafts = _drafts_from(h, want, rng) if step % 4 != 3 else {}
        if any(drafts.values()):
            accepted += sum(verify_decode(h, drafts).accepted)
        else:
            h.decode()
    assert accepted > 10
    h.release([ReleaseReq(rid, flush=True) for rid in prompts])
    for rid in prompts:
        n = min(len(h.out[rid]), 40)
        assert h.out[rid][:n] == want[rid][:n], rid
        h.assert_pool_holds(rid)  # the accepted tokens' KV, and no rejected draft's


def test_plain_rows_in_a_verify_step_sample_as_without_drafts(tiny_model):
    """A penalised row with logprobs (never drafted) next to a drafting row: its tokens
    and logprobs are those of the same steps without any drafts."""
    penalised = SamplingParams(
        temperature=0, repetition_penalty=1.3, logprobs=True, top_logprobs=2, max_new_tokens=64
    )
    runs = []
    for with_drafts in (False, True):
        h = Harness(tiny_model)
        rng = random.Random(5)
        prompts = {"plain": random_prompt(rng, 20, h.vocab), "pen": random_prompt(rng, 9, h.vocab)}
        want = {"plain": reference(h.path, prompts["plain"], 40)}
        h.extend([h.ereq("plain", prompts["plain"], sampling=greedy(64))])
        h.extend([h.ereq("pen", prompts["pen"], sampling=penalised)])
        lps = []
        for _ in range(8):
            n = len(h.out["plain"])
            drafts = {"plain": want["plain"][n : n + 3]} if with_drafts else {}
            res = verify_decode(h, drafts)
            lps.append(res.logprobs[res.rids.index("pen")])
        runs.append((h.out["pen"], lps))
    assert runs[0][0] == runs[1][0]
    assert runs[0][1] == pytest.approx(runs[1][1], abs=1e-4)  # a wider step rounds differently


def test_seeded_sampling_with_drafts_is_reproducible(tiny_model):
    """Drafts of the greedy continuation from where the row is, which a peaked sampler
    accepts often."""
    outs = []
    for _ in range(2):
        h = Harness(tiny_model, seed=11)
        prompt = random_prompt(random.Random(9), 12, h.vocab)
        h.extend([h.ereq("s", prompt, sampling=SamplingParams(temperature=0.3, seed=42))])
        for _ in range(10):
            verify_decode(h, {"s": reference(h.path, prompt + h.out["s"], 4)})
        outs.append(h.out["s"])
    assert outs[0] == outs[1] and len(outs[0]) > 15


def test_rejection_sampling_keeps_the_model_distribution():
    """With a point-mass draft, the token after a verify step is distributed as the
    model's own filtered distribution, whatever the draft."""
    import mlx.core as mx
    import numpy as np

    from worker_mlx.verify import verify

    logits = mx.array([[[2.0, 1.0, 0.5, 0.0, -1.0, -3.0], [0.0] * 6]])
    p = np.array(mx.softmax(logits[0, 0]))
    params = SamplingParams(temperature=1.0)
    for draft in (0, 3, 5):  # likely, unlikely, and almost never accepted
        counts = np.zeros(6)
        keys = mx.random.split(mx.random.key(draft), 3000)
        for key in keys:
            accepted, nxt = verify(logits, [[draft]], [params], [key])
            counts[draft if accepted[0] else nxt[0]] += 1
        np.testing.assert_allclose(counts / counts.sum(), p, atol=0.03)
