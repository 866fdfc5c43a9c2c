"""Speculative decoding with a draft model (`--speculative-algorithm draft`) in the worker.

The in-test scheduler (tests/test_model_runner.py's Harness) gives drafting rows fresh
slots and no tokens; the worker's draft model proposes them. The draft is the tiny
target's first layer (common.tiny_model.build_draft_model), whose drafts the target
accepts part of the time, or the whole target (every draft accepted: the K-th draft's KV
must still reach the draft pool). Rejected slots go straight back to the allocator and
are reused at once. Greedy output must stay mlx-lm's, the target pool must hold exactly
the accepted tokens' KV, and the draft pool the draft model's KV of the same tokens at
the same slots, for prefixes shared through the cache too.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import random
import re

import pytest

from common.messages import DecodeBatch, ReleaseReq, SamplingParams
from tests.conftest import load_model, mlx_greedy
from tests.test_metrics import PREFIX, scrape
from tests.test_model_runner import (
    N_SLOTS,
    Harness,
    greedy,
    random_prompt,
    reference,
    vocab_size,
)


@pytest.fixture(scope="module")
def one_layer_draft(tiny_model, tmp_path_factory) -> str:
    from common.tiny_model import build_draft_model

    return str(build_draft_model(tiny_model, tmp_path_factory.mktemp("draft"), layers=1))


@dataclasses.dataclass
class DraftView:
    """The draft's pool seen as a Harness, for `assert_pool_holds`."""

    h: Harness
    model: object
    pool: object

    def prefix(self, rid: str):
        return self.h.prefix(rid)


def harness_with_draft(target: str, draft: str, seed: int = 0) -> tuple[Harness, DraftView]:
    from worker_mlx.draft_model import DraftModel
    from worker_mlx.kv_pool import MlxKVPool
    from worker_mlx.model_probe import probe_kv_layout
    from worker_mlx.model_runner import ModelRunner

    model, _ = load_model(draft)
    pool = MlxKVPool(probe_kv_layout(model), N_SLOTS)
    drafter = DraftModel(ModelRunner(model, pool, vocab_size(target), compile_decode=True))
    h = Harness(target, seed=seed, proposer=drafter)
    return h, DraftView(h, model, pool)


def draft_decode(h: Harness, k: dict[str, int]):
    """One decode step of every running request, `k[rid]` drafts each (the descriptor
    says the same rows come next, and the worker's run-ahead follows it)."""
    rids = list(h.running)
    locs = h.alloc.alloc(len(rids))
    dl = [h.alloc.alloc(k.get(rid, 0)) for rid in rids]
    h.step += 1
    drafting = any(dl)
    batch = DecodeBatch(
        h.step, rids, locs, drafts=[[] for _ in rids] if drafting else [],
        draft_slots=dl if drafting else [], lookahead=True, worker_drafts=drafting,
    )  # fmt: skip
    res = h.worker.decode(batch)
    h.worker.run_ahead()  # as the worker does after each reply
    assert res.rids == rids and res.guesses is not None and len(res.guesses) == len(rids)
    assert (res.proposed is not None) == drafting
    accepted = res.accepted or [0] * len(rids)
    for i, rid in enumerate(rids):
        d, a = res.proposed[i] if drafting else [], accepted[i]
        assert len(d) == len(dl[i]) and 0 <= a <= len(dl[i])
        assert (res.guesses[i] is None) == bool(dl[i])  # a guess for a row without drafts
        h.slots[rid] += [locs[i]] + dl[i][:a]
        h.tokens[rid] += [h.out[rid][-1]] + d[:a]
        h.out[rid] += d[:a] + [res.next_token_ids[i]]
        h.alloc.free(dl[i][a:][::-1])
    return res


@pytest.mark.parametrize("whole", [False, True], ids=["first-layer", "target-as-draft"])
def test_draft_model_steps_match_mlx_lm(tiny_model, one_layer_draft, whole):
    h, view = harness_with_draft(tiny_model, tiny_model if whole else one_layer_draft)
    rng = random.Random(4)
    prompts = {f"r{i}": random_prompt(rng, rng.randint(1, 40), h.vocab) for i in range(3)}
    want = {rid: reference(h.path, p, 40) for rid, p in prompts.items()}
    h.extend([h.ereq(rid, p, sampling=greedy(64)) for rid, p in prompts.items()])
    accepted = drafted = 0
    for step in range(14):
        if step == 4:  # a turn on r0's output so far: a prefix hit on generated tokens
            n = len(h.slots["r0"])
            h.runner.ledger.flush()
            tail = random_prompt(rng, 5, h.vocab)
            prompts["hit"] = h.tokens["r0"] + tail
            want["hit"] = reference(h.path, prompts["hit"], 40)
            h.extend([h.ereq("hit", tail, prefix=h.prefix("r0", n), sampling=greedy(64))])
        k = {rid: rng.choice([0, 1, 3, 5]) for rid in h.running} if step % 5 != 4 else {}
        drafted += sum(k.values())
        accepted += sum(draft_decode(h, k).accepted or [])
    assert 0 < accepted <= drafted
    if whole:
        assert accepted == drafted  # the target agrees with itself
    h.release([ReleaseReq(rid, flush=True) for rid in prompts])
    for rid in prompts:
        n = min(len(h.out[rid]), 40)
        assert h.out[rid][:n] == want[rid][:n], rid
        h.assert_pool_holds(rid)
        Harness.assert_pool_holds(view, rid)  # the draft's KV of the same tokens


def test_guesses_and_steps_computed_ahead(tiny_model):
    """With the target as its own draft, the guess reported for a row without drafts is
    the token the step produced. Plain steps in a row use the draft's column computed
    ahead; a drafting step, a prefill and a release take it back first."""
    h, view = harness_with_draft(tiny_model, tiny_model)
    rng = random.Random(8)
    prompts = {rid: random_prompt(rng, 20, h.vocab) for rid in ("a", "b", "late")}
    want = {rid: reference(h.path, p, 40) for rid, p in prompts.items()}
    h.extend([h.ereq(rid, prompts[rid], sampling=greedy(64)) for rid in ("a", "b")])
    guessed = 0
    for step in range(14):
        if step == 6:
            h.extend([h.ereq("late", prompts["late"], sampling=greedy(64))])
        if step == 10:
            h.release([ReleaseReq("b", flush=True)])
        res = draft_decode(h, {"a": 2} if step % 4 == 3 else {})
        for i, rid in enumerate(res.rids):
            if not res.accepted:
                assert res.guesses[i] == res.next_token_ids[i], (step, rid)
                guessed += 1
    assert guessed > 20
    h.release([ReleaseReq(rid, flush=True) for rid in ("a", "late")])
    for rid in prompts:
        n = min(len(h.out[rid]), 40)
        assert h.out[rid][:n] == want[rid][:n], rid
        Harness.assert_pool_holds(view, rid)


def test_seeded_sampling_with_a_draft_model_is_reproducible(tiny_model, one_layer_draft):
    outs = []
    for _ in range(2):
        h, _ = harness_with_draft(tiny_model, one_layer_draft, seed=11)
        prompt = random_prompt(random.Random(9), 12, h.vocab)
        h.extend([h.ereq("s", prompt, sampling=SamplingParams(temperature=0.3, seed=42))])
        for _ in range(10):
            draft_decode(h, {"s": 3})
        outs.append(h.out["s"])
    assert outs[0] == outs[1] and len(outs[0]) > 10


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_model, tmp_path, caplog):
    from common.server_args import ServerArgs
    from common.tiny_model import build_tiny_model
    from worker_mlx.backends import select
    from worker_mlx.loader import _load_draft

    other = build_tiny_model(tmp_path / "other", vocab_size=300)
    _, tokenizer = load_model(tiny_model)
    args = ServerArgs(
        model_path=tiny_model,
        speculative_algorithm="draft",
        speculative_draft_model_path=str(other),
    )
    with caplog.at_level(logging.ERROR, logger="worker"), pytest.raises(SystemExit):
        _load_draft(args, select(), tokenizer, vocab_size(tiny_model), 4096)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "needs the target's vocabulary" in line and str(other) in line


# ---------------------------------------------------------------- through a real server


@pytest.fixture(scope="module", params=["first-layer", "agreeing"])
def draft_pair(request, tiny_model, one_layer_draft, tmp_path_factory):
    """(target, draft, least top accept len): the tiny model and its first layer (drafts
    rarely accepted, rows drafting only now and then: whether any is, within the test,
    rests on the step-cost gate's timings of this machine, so None), or a target whose
    second layer adds nothing and its first layer (every draft accepted)."""
    if request.param == "first-layer":
        return tiny_model, one_layer_draft, None
    from common.tiny_model import build_draft_model, build_tiny_model

    out = tmp_path_factory.mktemp("agreeing")
    target = build_tiny_model(out / "target", silent_from=1)
    return str(target), str(build_draft_model(target, out / "draft", layers=1)), 3.0


@pytest.fixture(scope="module")
def draft_server(draft_pair, tmp_path_factory):
    from tests.server import ServerProcess

    target, draft, _ = draft_pair
    log = tmp_path_factory.mktemp("draft-spec") / "server.log"
    server = ServerProcess(
        target,
        log,
        extra=[
            "--speculative-algorithm", "draft", "--speculative-draft-model-path",
            draft, "--speculative-num-draft-tokens", "4", "--max-total-tokens",
            "400", "--debug-invariants", "--decode-log-interval", "5",
            "--chunked-prefill-size", "32",
        ],
    )  # fmt: skip
    server.start()
    yield server
    server.stop()


@pytest.mark.slow
def test_batched_draft_speculation_matches_mlx_lm(draft_server, draft_pair):
    """Ten requests at once in a pool of 400 tokens (it evicts, and may retract), some
    sharing a prefix, prompts prefilled in chunks of 32; then a conversation whose turns
    hit the cache."""
    from tests.test_speculative_e2e import _complete, _mixed_load

    target, _, least_accept = draft_pair
    load = _mixed_load(1)
    with concurrent.futures.ThreadPoolExecutor(len(load)) as pool:
        results = list(pool.map(lambda item: _complete(draft_server.url, {
            "prompt": item[0], "max_tokens": item[1]}), load))  # fmt: skip
    for (prompt, n), res in zip(load, results):
        assert "choices" in res, res
        assert res["choices"][0]["token_ids"] == mlx_greedy(target, prompt, n)
    rng = random.Random(7)
    history = random_prompt(rng, 20, 500)
    for _ in range(3):
        res = _complete(draft_server.url, {"prompt": history, "max_tokens": 25})
        out = res["choices"][0]["token_ids"]
        assert out == mlx_greedy(target, history, 25)
        history = history + out + random_prompt(rng, 3, 500)
    assert res["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    log = draft_server.log()
    assert "Traceback" not in log and "two owners" not in log and "slots lost" not in log
    accept = [float(x) for x in re.findall(r"accept len: ([0-9.]+)", log)]
    assert accept, log[-2000:]
    if least_accept is not None:  # drafts accepted, not just sent
        assert max(accept) > least_accept, accept
    assert scrape(draft_server.url)[PREFIX + "evicted_tokens_total"] > 0


@pytest.mark.slow
def test_seeded_sampling_with_draft_speculation_is_reproducible(draft_server):
    from tests.test_speculative_e2e import _complete

    body = {"prompt": [21, 22, 23, 24, 25] * 5, "max_tokens": 30, "temperature": 0.7, "seed": 5}
    first = _complete(draft_server.url, body)["choices"][0]["token_ids"]
    again = _complete(draft_server.url, body)["choices"][0]["token_ids"]
    assert first == again and len(first) == 30
    assert _complete(draft_server.url, body | {"seed": 6})["choices"][0]["token_ids"] != first


def test_bad_draft_descriptors_get_a_clear_error_and_the_requests_go_on(
    tiny_model, one_layer_draft
):
    h, view = harness_with_draft(tiny_model, one_layer_draft)
    prompt = random_prompt(random.Random(2), 10, h.vocab)
    want = reference(h.path, prompt, 12)
    h.extend([h.ereq("a", prompt, sampling=greedy(64))])
    cases = [
        ([[5]], [h.alloc.alloc(1)], False, "send slots, no tokens"),
        ([[5]], [h.alloc.alloc(1)], True, "worker_drafts: send slots, no tokens"),
        ([[]], [h.alloc.alloc(17)], True, "at most 16"),
        ([[]], [[h.pool.num_slots + 1]], True, "outside the pool"),
    ]
    for drafts, locs, asked, message in cases:
        batch = DecodeBatch(
            99, ["a"], h.alloc.alloc(1), drafts=drafts, draft_slots=locs, worker_drafts=asked
        )
        with pytest.raises(ValueError, match=message):
            h.worker.decode(batch)
    for _ in range(4):
        draft_decode(h, {"a": 3})
    assert h.out["a"] == want[: len(h.out["a"])]
    h.release([ReleaseReq("a", flush=True)])
    Harness.assert_pool_holds(view, "a")


def test_an_auto_sized_pool_counts_both_models_bytes_per_slot(tiny_model, one_layer_draft):
    from worker_mlx.kv_pool import pool_size
    from worker_mlx.model_probe import probe_kv_layout

    target = probe_kv_layout(load_model(tiny_model)[0])
    draft = probe_kv_layout(load_model(one_layer_draft)[0])
    assert draft.bytes_per_slot * 2 == target.bytes_per_slot  # 1 layer of the target's 2
    budget = 3 << 20
    alone = pool_size(target, 0.5, budget)
    both = pool_size(target, 0.5, budget, draft.bytes_per_slot)
    assert both * (target.bytes_per_slot + draft.bytes_per_slot) <= budget // 2
    assert both == budget // 2 // (target.bytes_per_slot + draft.bytes_per_slot) < alone


def test_the_draft_flags_go_together():
    from common.server_args import ServerArgs

    for args in (
        ServerArgs("/t", speculative_algorithm="draft"),
        ServerArgs("/t", speculative_algorithm="ngram", speculative_draft_model_path="/m"),
    ):
        with pytest.raises(ValueError, match="go together"):
            args.validate()
    ServerArgs("/t", speculative_algorithm="draft", speculative_draft_model_path="/m").validate()
