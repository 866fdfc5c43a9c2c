"""The real scheduler process against a scripted worker that checks the slot contract.

Each test spawns `scheduler.process.run_scheduler` with `debug_invariants=True` (an invariant
failure kills it, which the harness reports with the exit code) and plays the worker and the
router on real ZMQ sockets; see tests/scripted_worker.py for what is checked.
"""

from __future__ import annotations

import json
import random
import time

import msgpack
import pytest

from common.messages import (
    DecodeBatch,
    ExtendBatch,
    ExtendReq,
    HoldAhead,
    ReleaseBatch,
    ReleaseReq,
    SamplingParams,
)
from radix_mlx.protocol import PROTOCOL_VERSION
from tests.scripted_worker import (
    VOCAB,
    ReqSpec,
    SchedulerHarness,
    ScriptedModel,
    ScriptedWorker,
    toks,
)

V = VOCAB


def decodes_of(rid: str):
    """Hook predicate: the worker got a DecodeBatch containing `rid`."""
    return lambda msg: isinstance(msg, DecodeBatch) and rid in msg.rids


def abort_on(h: SchedulerHarness, rid: str, pred, times: int = 1) -> None:
    """Send AbortReq(rid) when the worker sees the `times`-th message matching `pred`,
    before it answers, so the abort reaches the scheduler while that step is in flight."""
    seen = [0]

    def hook(msg) -> bool:
        if pred(msg):
            seen[0] += 1
            if seen[0] == times:
                h.abort(rid)
                time.sleep(0.02)  # the abort lands before the scheduler sees the result
                return True
        return False

    h.on_worker(hook)


# ---------------------------------------------------------------- the checker has teeth


def _worker_with(prompts: dict[str, list[int]]) -> ScriptedWorker:
    model = ScriptedModel(V, [0, 1])
    w = ScriptedWorker(32, model)
    for rid, prompt in prompts.items():
        model.specs[rid] = ReqSpec(rid, prompt, SamplingParams(max_new_tokens=8))
        w.register(rid, prompt)
    return w


def _ext(rid, ids, prefix, locs, last=True) -> ExtendReq:
    return ExtendReq(rid, ids, prefix, locs, SamplingParams(max_new_tokens=8), last_chunk=last)


def test_scripted_worker_flags_contract_violations():
    def run(*msgs) -> list[str]:
        w = _worker_with({"a": [5, 6, 7, 8], "b": [5, 6, 7, 9, 10], "c": [3, 4]})
        w.handle(ExtendBatch(1, [_ext("a", [5, 6, 7, 8], [], [1, 2, 3, 4])]))
        w.handle(ExtendBatch(2, [_ext("c", [3, 4], [], [5, 6])]))
        for m in msgs:
            w.handle(m)
        return w.violations

    assert run() == []
    a_out = _worker_with({"a": [5, 6, 7, 8]}).model.preview([5, 6, 7, 8], 1)
    shared = ExtendBatch(3, [_ext("b", [9, 10], [1, 2, 3], [7, 8])])
    assert run(shared) == []  # a correct shared prefix
    assert "still held" in run(ExtendBatch(3, [_ext("b", [9, 10], [1, 2, 3], [4, 8])]))[0]
    assert "a's token at position 3" in run(ExtendBatch(3, [_ext("b", [10], [1, 2, 3, 4], [7])]))[0]
    assert "input_ids" in run(ExtendBatch(3, [_ext("b", [9, 11], [1, 2, 3], [7, 8])]))[0]
    assert "twice in one step" in run(DecodeBatch(3, ["a", "c"], [9, 9]))[0]
    assert "not a live decoding" in run(DecodeBatch(3, ["b"], [9]))[0]
    assert "holds no slots" in run(ReleaseBatch(3, [ReleaseReq("b", True)]))[0]
    pending = DecodeBatch(3, ["a", "c"], [9, 10])
    assert "deferred flush is pending" in run(pending, DecodeBatch(4, ["a", "c"], [11, 9]))[0]
    # a prompt continuing a's output reads slot 9: flushed it holds a's KV, dropped it does not
    cont = {"d": [5, 6, 7, 8, *a_out, 42]}
    for flush, ok in ((True, True), (False, False)):
        w = _worker_with({"a": [5, 6, 7, 8], **cont})
        w.handle(ExtendBatch(1, [_ext("a", [5, 6, 7, 8], [], [1, 2, 3, 4])]))
        w.handle(DecodeBatch(2, ["a"], [9]))
        w.handle(ReleaseBatch(3, [ReleaseReq("a", flush)]))
        w.handle(ExtendBatch(4, [_ext("d", [42], [1, 2, 3, 4, 9], [10])]))
        assert (w.violations == []) == ok, w.violations


# ---------------------------------------------------------------- scenarios


def test_plain_mix_with_shared_prefixes(make_harness):
    h = make_harness(1024)
    rng = random.Random(1)
    base1, base2 = toks(rng, 40), toks(rng, 20)
    a0 = h.submit("a0", base1 + toks(rng, 5), 12)
    h.wait_done()
    a0_out = h.results["a0"].tokens
    assert h.results["a0"].cached_tokens == 0
    stop = h.model.preview(toks(random.Random(5), 30), 6)[2]
    h.submit("a1", base1 + toks(rng, 7), 10)
    h.submit("a2", base1 + toks(rng, 3), 5, eos_at=2)  # stops at eos
    h.submit("a3", base2 + toks(rng, 10), 8)
    h.submit("a4", base2 + toks(rng, 4), 20, eos_at=3, ignore_eos=True)  # eos is just a token
    h.submit("a5", toks(random.Random(5), 30), 6, stop_token_ids=[stop])  # stop token
    h.submit("a6", base1 + base2, 15)
    h.submit("a7", base1, 4)  # the whole prompt is cached: one token is still computed
    # a prompt that continues a0's generated tokens reads a0's flushed decode KV
    h.submit("a8", a0.prompt + a0_out[:11] + [7], 6)
    h.submit("a9", toks(rng, 9), 1)
    h.wait_idle()
    h.verify()
    r = h.results
    assert r["a2"].finish == "stop" and r["a5"].finish == "stop" and r["a4"].finish == "length"
    assert r["a1"].cached_tokens >= 40 and r["a6"].cached_tokens >= 40
    assert r["a7"].cached_tokens == 39
    assert r["a8"].cached_tokens == len(a0.prompt) + 11  # prompt + every decoded token's KV
    assert h.worker.counts["flush"] == 10 and h.worker.counts["drop"] == 0


def test_tiny_pool_evicts_and_retracts(make_harness):
    h = make_harness(128)
    rng = random.Random(2)
    shared = toks(rng, 20)
    for i in range(16):
        prompt = (shared if i % 2 == 0 else []) + toks(rng, rng.randrange(4, 30))
        h.submit(f"b{i}", prompt, rng.randrange(20, 60), eos_at=rng.choice([None, None, 15]))
    stats = h.wait_idle(timeout=20)
    h.verify()
    assert stats.retracted_requests > 0, stats
    assert stats.evicted_tokens > 0, stats
    assert stats.capacity == 128


def test_retracted_request_resumes_from_its_flushed_decode_kv(make_harness):
    """Retraction releases with flush=True and puts the decode tokens in the trie; if the
    pressure goes away at once, the request resumes by reading that KV back.

    Staged so the retraction step still has one old 1-token leaf to evict: 29 one-token
    prompts leave 29 such leaves, then a (10 tokens) and b (11) decode two slots a step
    from an odd budget, so it reaches 1 with one old leaf left and b (the later arrival,
    tied on outputs) is retracted; a is then aborted before b's leaf can be evicted.
    """
    h = make_harness(128)
    rng = random.Random(9)
    a, b = toks(rng, 10), toks(rng, 11)
    comb = [t for t in range(2, V) if t not in (a[0], b[0])][:29]
    for t in comb[:-1]:
        h.submit(f"one{t}", [t], 1)
    h.wait_done()

    def submit_pair(msg) -> bool:
        """a and b arrive while the last one-token prompt is in flight, so both wait and are
        admitted in one prefill batch: the staging needs them in lockstep."""
        if isinstance(msg, ExtendBatch) and any(r.rid == "last" for r in msg.reqs):
            h.submit("a", a, 70)  # admitted at prompt + 0.7 * 70 each; together they need 161
            h.submit("b", b, 70)
            time.sleep(0.05)
            return True
        return False

    h.on_worker(submit_pair)
    h.submit("last", [comb[-1]], 1)

    def hook(msg) -> bool:
        if any(r.rid == "b" for r in msg.release) and not h.done("b"):
            h.abort("a")  # b was retracted: free the pool before its decode KV is evicted
            time.sleep(0.05)  # let the abort land while this step is in flight
            return True
        return False

    h.on_worker(hook)
    stats = h.wait_idle(timeout=10)
    h.verify()
    assert stats.retracted_requests == 1
    resume = h.worker.extends["b"][1]
    assert len(resume.prefix_slot_ids) > 11 + 20, resume  # the prompt and the decode KV
    assert h.results["b"].finish == "length" and h.results["a"].finish == "abort"


def test_a_prompt_arriving_mid_decode_holds_the_step_computed_ahead(make_harness):
    """A decode step is sent to be followed by one computed ahead; a prompt that arrives
    while it is in flight makes the scheduler send HoldAhead for that step (once), and
    the prompt's extend is the next step: the worker computes nothing it would throw
    away before that extend."""
    h = make_harness(512)
    sent = []

    def hook(msg) -> bool:
        if isinstance(msg, DecodeBatch) and msg.lookahead and len(msg.rids) == 1:
            h.submit("b", list(range(40, 52)), 4)
            time.sleep(0.05)  # b lands while this step is in flight
            return True
        return False

    h.on_worker(lambda msg: sent.append(msg))  # (None: kept)
    h.on_worker(hook)
    h.submit("a", list(range(10, 22)), 12)
    h.wait_idle(timeout=10)
    h.verify()
    held = next(i for i, m in enumerate(sent) if isinstance(m, HoldAhead))
    assert sent[held].step == sent[held - 1].step and sent[held - 1].lookahead
    after = sent[held + 1]
    assert isinstance(after, ExtendBatch) and [r.rid for r in after.reqs] == ["b"]
    assert h.worker.counts["hold_ahead"] == 1


def test_aborts_free_every_slot(make_harness):
    h = make_harness(512, chunked_prefill_size=16, max_running_requests=3)
    rng = random.Random(3)
    for i in range(3):  # three long runners take every seat
        h.submit(f"r{i}", toks(rng, 10), 60 + 20 * i)
    h.run_until(lambda: h.worker.counts["decode"] > 0, 5, "the runners to decode")
    h.submit("w", toks(rng, 10), 5)  # no seat: it waits...
    h.abort("w")  # ...and is aborted while waiting
    h.run_until(lambda: h.done("w"), 5, "the waiting abort")
    abort_on(h, "r0", decodes_of("r0"), times=5)  # running abort, mid-step
    h.run_until(lambda: h.done("r0"), 5, "the running abort")
    abort_on(h, "c", lambda m: isinstance(m, ExtendBatch) and m.reqs[0].rid == "c")
    h.submit("c", toks(rng, 80), 10)  # aborted during its first of five chunks
    h.run_until(lambda: h.done("c"), 5, "the chunked abort")
    abort_on(h, "e", lambda m: isinstance(m, ExtendBatch) and "e" in [r.rid for r in m.reqs])
    h.submit("e", toks(rng, 12), 50)  # aborted while its (single-chunk) prefill is in flight
    h.submit("d", toks(rng, 8), 6)  # an ordinary request keeps working meanwhile
    h.abort("nobody")  # unknown rids are ignored
    h.after(0.05, lambda: h.abort("r2"))
    stats = h.wait_idle(timeout=10)
    h.verify()
    r = h.results
    assert r["w"].finish == "abort" and r["w"].tokens == [] and "w" not in h.worker.extends
    assert r["r0"].finish == "abort" and len(r["r0"].tokens) >= 5
    assert r["c"].finish == "abort" and r["c"].tokens == []
    assert [x.last_chunk for x in h.worker.extends["c"]] == [False]
    assert r["e"].finish == "abort" and len(r["e"].tokens) <= 1
    assert r["r1"].finish == "length" and r["d"].finish == "length"
    assert r["r2"].finish in ("abort", "length")
    aborted = sum(x.finish == "abort" for x in r.values() if x is not r["w"])
    assert h.worker.counts["drop"] == aborted  # aborted KV is dropped, not flushed
    assert stats.num_running == 0 and stats.token_usage == 0


def test_chunked_prefill_small_chunks(make_harness):
    h = make_harness(1024, chunked_prefill_size=8)
    rng = random.Random(4)
    shared = toks(rng, 36)
    for i in range(6):
        prompt = shared + toks(rng, 4) if i < 3 else toks(rng, 40)
        h.submit(f"d{i}", prompt, 8 + i)
    h.wait_idle()
    h.verify()
    for i in range(6):
        chunks = h.worker.extends[f"d{i}"]
        assert [c.last_chunk for c in chunks] == [False] * (len(chunks) - 1) + [True]
        assert all(len(c.input_ids) <= 8 for c in chunks)
        assert len(chunks[0].prefix_slot_ids) + sum(len(c.input_ids) for c in chunks) == 40
    assert all(len(h.worker.extends[f"d{i}"]) == 5 for i in (0, 3, 4, 5))
    # the twins wait for d0 to compute the shared 36 tokens, then reuse them
    assert h.results["d1"].cached_tokens >= 32 and h.results["d2"].cached_tokens >= 32


def test_disable_radix_cache(make_harness):
    h = make_harness(160, disable_radix_cache=True)
    rng = random.Random(5)
    shared = toks(rng, 30)
    h.submit("x0", shared + toks(rng, 5), 10)
    h.wait_done()
    for i in range(1, 9):
        h.submit(f"x{i}", shared + toks(rng, rng.randrange(1, 10)), rng.randrange(20, 50))
    stats = h.wait_idle(timeout=20)
    h.verify()
    assert all(r.cached_tokens == 0 for r in h.results.values())
    assert all(not ext.prefix_slot_ids for e in h.worker.extends.values() for ext in e[:1])
    assert stats.retracted_requests > 0  # resumed requests recompute everything
    assert stats.evicted_tokens == 0


def test_request_that_can_never_fit(make_harness):
    h = make_harness(128, context_len=256)
    rng = random.Random(6)
    h.submit("ok0", toks(rng, 10), 100)
    h.submit("ok1", toks(rng, 10), 100)
    h.run_until(lambda: h.worker.counts["decode"] > 0, 5, "decoding")
    h.submit("big", toks(rng, 100), 40, expect_error="kv_pool_too_small")
    h.submit("long", toks(rng, 200), 100, expect_error="context_length_exceeded")
    h.run_until(lambda: h.done("big") and h.done("long"), 5, "the refusals")
    assert not h.done("ok0") and not h.done("ok1")  # refused at once, not after the others
    err = h.results["big"].error
    assert "128" in err.message and "--max-total-tokens" in err.message, err
    assert "256" in h.results["long"].error.message
    h.submit("ok2", toks(rng, 20), 90)  # exactly fills the pool with ok0 and ok1 gone
    h.submit("ok3", toks(rng, 120), 8)
    h.wait_idle(timeout=10)
    h.verify()


def test_garbage_frames_from_router(make_harness):
    h = make_harness(256)
    rng = random.Random(7)
    h.submit("g0", toks(rng, 10), 30)
    h.run_until(lambda: h.worker.counts["decode"] > 0, 5, "decoding")
    h.send_raw(msgpack.packb({"type": "GenerateReq", "v": PROTOCOL_VERSION, "rid": "bad"}))
    h.send_raw(b"\xc1 not msgpack")  # no rid: logged and dropped
    h.send_raw(
        msgpack.packb(
            {"type": "GenerateReq", "v": PROTOCOL_VERSION, "rid": "bad2", "input_ids": "x"}
        )
    )
    h.send_raw(msgpack.packb({"type": "GenerateReq", "v": 99, "rid": "bad3"}))
    h.send_raw(
        msgpack.packb(
            {"type": "TokenOutBatch", "v": PROTOCOL_VERSION, "rid": "bad4", "outputs": []}
        )
    )
    h.send_raw(msgpack.packb([1, 2, 3]))
    h.run_until(lambda: len(h.other_errors) == 4, 5, "ReqErrors for the bad frames")
    assert "missing field" in h.other_errors["bad"].message
    assert "input_ids" in h.other_errors["bad2"].message
    assert "version" in h.other_errors["bad3"].message
    assert "unknown message type" in h.other_errors["bad4"].message
    h.submit("g1", toks(rng, 12), 10)
    h.wait_idle()
    h.verify()


def test_chunked_prefill_over_a_cached_prefix_under_pressure(make_harness):
    """Regression: a chunked prompt admitted against an evictable cached prefix.

    The admission budget counted that prefix as reclaimable, then admission locked it, so
    the later chunks could not get slots; the half-prefilled request (not retractable)
    then starved the lone decoding request and the scheduler died with "no KV slot for a
    lone running request".
    """
    h = make_harness(128, chunked_prefill_size=16)
    rng = random.Random(8)
    prefix = toks(rng, 50)
    h.submit("p0", prefix, 1)  # leaves 50 evictable tokens in the trie
    h.wait_done()
    h.submit("r1", toks(rng, 20), 40)
    n = [0]

    def hook(msg) -> bool:
        n[0] += isinstance(msg, DecodeBatch) and "r1" in msg.rids
        if n[0] == 10:  # r1 holds ~30 slots and reserves ~20: the budget says 98 - 20
            h.submit("c", prefix + toks(rng, 60), 10)  # 60 new tokens in four chunks
            return True
        return False

    h.on_worker(hook)
    h.wait_idle(timeout=10)
    h.verify()
    assert h.results["c"].cached_tokens == 50


# ---------------------------------------------------------------- randomized stress


def _stress(h: SchedulerHarness, seed: int) -> None:
    rng = random.Random(seed)
    bases = [toks(rng, rng.randrange(8, 50)) for _ in range(4)]
    for i in range(30):
        prompt = (rng.choice(bases) if rng.random() < 0.6 else []) + toks(rng, rng.randrange(1, 30))
        if rng.random() < 0.1:  # a prompt that continues an earlier prompt
            prompt = rng.choice(bases) + rng.choice(bases)
        max_new = rng.randrange(1, 40)
        eos_at = rng.randrange(0, max_new) if rng.random() < 0.2 else None
        kw = dict(eos_at=eos_at, ignore_eos=rng.random() < 0.2)
        if len(prompt) + max_new > h.num_slots:  # only with pools smaller than the suite's
            kw["expect_error"] = "kv_pool_too_small"
        if rng.random() < 0.2:  # penalties make the scheduler send the history along
            kw["repetition_penalty"] = 1.1
        arrival = rng.uniform(0, 0.6)
        h.after(arrival, lambda i=i, p=prompt, n=max_new, kw=kw: h.submit(f"s{i}", p, n, **kw))
        if rng.random() < 0.15:
            h.after(arrival + rng.uniform(0, 0.1), lambda i=i: h.abort(f"s{i}"))
    h.run_until(lambda: not h.timers, 5, "every arrival")
    stats = h.wait_idle(timeout=20)
    h.verify()
    assert stats.num_running == 0 and stats.token_usage == 0


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_randomized_stress(make_harness, seed):
    rng = random.Random(seed)
    h = make_harness(
        200,
        chunked_prefill_size=rng.choice([8, 24, 64, 2048]),
        max_running_requests=rng.choice([4, 16, 64]),
        schedule_policy=rng.choice(["lpm", "fcfs"]),
    )
    _stress(h, seed)


@pytest.mark.parametrize("seed", [21, 22])
def test_randomized_stress_with_state_slots(make_harness, seed):
    """A model with recurrent layers and fewer state slots than seats (see also
    tests/test_scheduler_states.py): requests wait for one, never fail."""
    rng = random.Random(seed)
    h = make_harness(
        200,
        num_state_slots=rng.choice([2, 3, 6]),
        chunked_prefill_size=rng.choice([8, 24, 2048]),
        max_running_requests=rng.choice([4, 16]),
    )
    _stress(h, seed)


# ---------------------------------------------------------------- the benchmark


def test_bench_scheduler_smoke(tmp_path):
    from benchmarks import scheduler_micro

    out = tmp_path / "bench.jsonl"
    scheduler_micro.main(
        ["--requests", "8", "--steps", "20", "--trie-requests", "200", "--out", str(out)]
    )
    row = json.loads(out.read_text().splitlines()[-1])
    assert row["decode_step_ms_median"] > 0 and row["trie_tokens_per_s"] > 0


def test_token_usage_alone_is_reported_at_most_every_usage_interval(make_harness):
    """token_usage changes at every decode step; SchedulerStats that change nothing else go
    out at most every USAGE_INTERVAL, any other change at once: the stats that show the
    request finished come before its last token."""
    from scheduler.process import USAGE_INTERVAL

    h = make_harness(1024)
    h.submit("a", toks(random.Random(3), 20), 400)
    start = time.monotonic()
    h.wait_done()
    took = time.monotonic() - start
    during = [s for s, done in h.stats if done == 0 and s.num_running == 1]
    assert h.worker.counts["decode"] >= 399
    # one per interval at most, and the first step's; every step's usage differed
    assert len(during) <= took / USAGE_INTERVAL + 2, (len(during), took)
    assert any(s.num_running == 0 for s, done in h.stats if done == 0)  # before the last token
    h.wait_idle()
    h.verify()
