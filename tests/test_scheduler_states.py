"""Recurrent-state slots (models with recurrent layers): the real scheduler process against
the scripted worker, whose shadow state pool (tests/scripted_states.py) checks that every
`prefix_state` holds the state after exactly its prefix and no state slot has two users.

A hybrid model can only resume where the trie has a snapshot of the state, so these tests
check where snapshots are taken (chunk boundaries, prompt end minus one, finish) and that a
match falls back to the deepest one.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from common.messages import (
    ExtendBatch,
    ExtendReq,
    GenerateReq,
    ReleaseReq,
    SamplingParams,
    TokenOut,
    WorkerReady,
)
from common.server_args import ServerArgs
from scheduler.scheduler import Scheduler
from tests.scripted_worker import VOCAB, ReqSpec, ScriptedModel, ScriptedWorker, toks


def first_extend(h, rid: str) -> ExtendReq:
    return h.worker.extends[rid][0]


def snapshot_slots(h) -> set[int]:
    """Every state slot the scheduler asked to snapshot into (extends and releases)."""
    out = {s for e in h.worker.extends.values() for x in e for _, s in x.snapshots}
    return out | {s for v in h.worker.states.release_snapshots.values() for s in v}


def test_repeated_prompt_resumes_from_its_prompt_end_snapshot(make_harness):
    h = make_harness(1024, num_state_slots=8)
    prompt = toks(random.Random(1), 50)
    h.submit("a", prompt, 6)
    h.wait_idle()  # the releases too: they reach the worker after the last token
    a = first_extend(h, "a")
    assert a.state_slot != 0 and a.prefix_state == 0 and a.prefix_slot_ids == []
    [(n, at_49)] = a.snapshots
    assert n == 49  # the state after all the prompt but its last token
    assert len(h.worker.states.release_snapshots["a"]) == 1  # and after it finished
    h.submit("b", prompt, 6)
    h.wait_idle()
    h.verify()
    b = first_extend(h, "b")
    assert b.prefix_state == at_49 and len(b.prefix_slot_ids) == 49 and b.input_ids == prompt[-1:]
    assert b.snapshots == []  # the prefix is the snapshot it would take
    assert b.state_slot not in (0, at_49)
    assert h.results["b"].cached_tokens == 49


def test_second_turn_resumes_from_the_finish_snapshot(make_harness):
    h = make_harness(1024, num_state_slots=8)
    rng = random.Random(2)
    turn1 = toks(rng, 30)
    h.submit("t1", turn1, 10)
    h.wait_idle()  # the releases too: they reach the worker after the last token
    out = h.results["t1"].tokens
    [finish] = h.worker.states.release_snapshots["t1"]
    h.submit("t2", turn1 + out + toks(rng, 7), 5)
    h.wait_idle()
    h.verify()
    t2 = first_extend(h, "t2")
    # the KV (and the state) of the prompt and every output but the last, never computed
    assert t2.prefix_state == finish and len(t2.prefix_slot_ids) == 30 + 9
    assert h.results["t2"].cached_tokens == 39


def test_a_match_past_the_last_snapshot_falls_back_to_the_deepest_one(make_harness):
    h = make_harness(1024, num_state_slots=16, chunked_prefill_size=16)
    rng = random.Random(3)
    a = toks(rng, 50)  # chunks of 16, 16, 16, 2: snapshots at 16, 32, 48 and 49
    h.submit("a", a, 4)
    h.wait_idle()  # the releases too: they reach the worker after the last token
    chunks = h.worker.extends["a"]
    assert [c.snapshots[0][0] for c in chunks] == [16, 16, 16, 1]
    at_32 = chunks[1].snapshots[0][1]
    h.submit("b", a[:40] + toks(rng, 5), 4)  # the trie holds 40 of its tokens
    h.wait_idle()  # the releases too: they reach the worker after the last token
    b = first_extend(h, "b")
    assert b.prefix_state == at_32 and len(b.prefix_slot_ids) == 32
    assert h.results["b"].cached_tokens == 32
    h.submit("c", a[:10] + toks(rng, 5), 4)  # diverges before the first snapshot
    h.wait_idle()
    h.verify()
    c = first_extend(h, "c")
    assert c.prefix_state == 0 and c.prefix_slot_ids == [] and h.results["c"].cached_tokens == 0


def test_chunk_boundaries_carry_snapshots_and_continuations_keep_their_state(make_harness):
    h = make_harness(1024, num_state_slots=8, chunked_prefill_size=8)
    rng = random.Random(4)
    h.submit("d", toks(rng, 30), 5)  # chunks 8, 8, 8, 6
    h.wait_idle()
    h.verify()
    chunks = h.worker.extends["d"]
    assert len(chunks) == 4 and len({c.state_slot for c in chunks}) == 1
    assert [c.prefix_state for c in chunks] == [0] + [chunks[0].state_slot] * 3
    assert [c.snapshots[0][0] for c in chunks] == [8, 8, 8, 5]  # ends at 8, 16, 24; at 29
    slots = [c.snapshots[0][1] for c in chunks]
    assert len(set(slots)) == 4 and chunks[0].state_slot not in slots


def test_out_of_state_slots_requests_wait_and_snapshots_are_evicted(make_harness):
    h = make_harness(1024, num_state_slots=3, max_running_requests=8)
    rng = random.Random(5)
    prompts = [toks(rng, rng.randrange(5, 40)) for _ in range(8)]
    for i, p in enumerate(prompts):
        h.submit(f"q{i}", p, rng.randrange(5, 30))
    stats = h.wait_idle(timeout=10)
    h.verify()  # nobody failed; every state read matched (checked by the shadow)
    assert h.worker.max_decode_batch <= 3  # one working state slot each
    assert snapshot_slots(h)
    # the pool holds every token: only the snapshots' state slots made the trie evict
    assert stats.evicted_tokens > 0 and stats.retracted_requests == 0, stats


def test_tiny_pool_eviction_frees_snapshots(make_harness):
    """KV eviction takes snapshots with the leaves (the invariant check kills the scheduler
    if one leaks); a tiny pool retracts, and resumed requests match their finish snapshot."""
    h = make_harness(128, num_state_slots=6)
    rng = random.Random(6)
    shared = toks(rng, 20)
    for i in range(16):
        prompt = (shared if i % 2 == 0 else []) + toks(rng, rng.randrange(4, 30))
        h.submit(f"b{i}", prompt, rng.randrange(20, 60))
    stats = h.wait_idle(timeout=20)
    h.verify()
    assert stats.evicted_tokens > 0 and stats.retracted_requests > 0, stats
    resumed = [e[1] for e in h.worker.extends.values() if len(e) > 1]
    assert resumed and any(r.prefix_state for r in resumed)


def test_disable_radix_cache_uses_only_working_state_slots(make_harness):
    h = make_harness(256, num_state_slots=4, disable_radix_cache=True, chunked_prefill_size=16)
    prompt = toks(random.Random(7), 40)
    for i in range(4):
        h.submit(f"x{i}", prompt, 8)
    h.wait_idle()
    h.verify()
    exts = [x for e in h.worker.extends.values() for x in e]
    assert all(x.state_slot for x in exts) and not snapshot_slots(h)
    assert all(x.prefix_state == (x.state_slot if x.prefix_slot_ids else 0) for x in exts)


def test_shadow_states_flag_contract_violations():
    def run(n_states: int, *msgs) -> list[str]:
        model = ScriptedModel(VOCAB, [0, 1])
        w = ScriptedWorker(32, model, num_state_slots=n_states)
        for rid, prompt in {"a": [5, 6, 7, 8], "b": [5, 6, 7, 9]}.items():
            model.specs[rid] = ReqSpec(rid, prompt, SamplingParams(max_new_tokens=8))
            w.register(rid, prompt)
        for m in msgs:
            w.handle(m)
        return w.violations

    sp = SamplingParams(max_new_tokens=8)
    a = ExtendReq("a", [5, 6, 7, 8], [], [1, 2, 3, 4], sp, state_slot=1, snapshots=[[3, 2]])
    b_ok = ExtendReq("b", [9], [1, 2, 3], [5], sp, state_slot=3, prefix_state=2)
    assert run(4, ExtendBatch(1, [a]), ExtendBatch(2, [b_ok])) == []
    b_wrong = ExtendReq("b", [9], [1, 2, 3], [5], sp, state_slot=3, prefix_state=1)
    assert "not the state after 3" in run(4, ExtendBatch(1, [a]), ExtendBatch(2, [b_wrong]))[0]
    b_steal = ExtendReq("b", [9], [1, 2, 3], [5], sp, state_slot=1, prefix_state=2)
    assert "also in use" in run(4, ExtendBatch(1, [a]), ExtendBatch(2, [b_steal]))[0]
    assert "without state slots" in run(0, ExtendBatch(1, [a]))[0]
    bad_release = ExtendBatch(2, [b_ok], [ReleaseReq("a", flush=True, snapshot=1)])
    assert "live working" in run(4, ExtendBatch(1, [a]), bad_release)[0]


# ---------------------------------------------------------------- random workloads


def _run_in_process(prompts, max_new, *, num_slots, num_state_slots, **kw) -> ScriptedWorker:
    """The Scheduler class (no sockets) against the scripted worker, step by step, with the
    invariants checked after every step; returns the worker after every request ended."""
    args = ServerArgs(model_path="scripted", debug_invariants=True, **kw)
    model = ScriptedModel(VOCAB, [0, 1])
    worker = ScriptedWorker(num_slots, model, num_state_slots=num_state_slots)
    ready = WorkerReady(num_slots, "scripted", 1, 1, 1, "float16", 4096, VOCAB, [0, 1], "none")
    ready.num_state_slots = num_state_slots
    sched = Scheduler(args, ready)
    for i, (prompt, n) in enumerate(zip(prompts, max_new)):
        rid = f"r{i}"
        model.specs[rid] = ReqSpec(rid, prompt, SamplingParams(max_new_tokens=n, temperature=0))
        worker.register(rid, prompt)
        sched.on_request(GenerateReq(rid, prompt, model.specs[rid].sampling))
    outputs: dict[str, list[int]] = {}
    for _ in range(10_000):
        batch = sched.next_batch()
        if batch is None:
            break
        result = worker.handle(batch)
        if result is not None:
            sched.on_result(result)
        for out in sched.take_outputs():
            assert isinstance(out, TokenOut), out  # never an error: requests wait instead
            outputs.setdefault(out.rid, []).extend(out.token_ids)
    assert not sched.busy and not worker.live and worker.violations == []
    assert outputs == {rid: model.expected(rid)[0] for rid in model.specs}
    return worker


@settings(max_examples=40, deadline=None)
@given(
    st.data(),
    st.integers(1, 4),  # state slots: fewer than the running requests
    st.sampled_from([4, 8, 2048]),  # chunked prefill size
    st.booleans(),
)
def test_random_workloads_keep_state_slots_accounted(data, num_state_slots, chunk, disable):
    bases = data.draw(st.lists(st.lists(st.integers(2, 40), min_size=1, max_size=12), min_size=1))
    n = data.draw(st.integers(1, 10))
    prompts = [
        data.draw(st.sampled_from(bases)) + data.draw(st.lists(st.integers(2, 40), max_size=6))
        for _ in range(n)
    ]
    prompts = [p[:40] for p in prompts]
    max_new = data.draw(st.lists(st.integers(1, 12), min_size=n, max_size=n))
    _run_in_process(
        prompts,
        max_new,
        num_slots=64,
        num_state_slots=num_state_slots,
        chunked_prefill_size=chunk,
        max_running_requests=4,
        disable_radix_cache=disable,
    )


def test_a_shared_system_prompt_is_reused_from_the_branch_point(make_harness):
    """The second prompt matches the first one's KV past any snapshot: it recomputes from
    the deepest snapshot and snapshots where it branches off, so the third resumes there."""
    h = make_harness(1024, num_state_slots=16)
    rng = random.Random(8)
    system = toks(rng, 60)
    h.submit("a", system + toks(rng, 10), 4)
    h.wait_idle()  # the releases too: they reach the worker after the last token
    h.submit("b", system + toks(rng, 12), 4)
    h.wait_idle()
    b = first_extend(h, "b")
    assert b.prefix_slot_ids == [] and [60, b.snapshots[0][1]] in b.snapshots
    h.submit("c", system + toks(rng, 8), 4)
    h.wait_idle()
    h.verify()
    c = first_extend(h, "c")
    assert c.prefix_state == b.snapshots[0][1] and h.results["c"].cached_tokens == 60


def test_prompts_arriving_together_share_a_prefix_through_a_twin_snapshot():
    """One computes the shared prefix and snapshots its end; the others wait a round and
    resume there (and the same prompt twice resumes at its last token)."""
    rng = random.Random(9)
    system = toks(rng, 50)
    prompts = [system + toks(rng, 6) for _ in range(3)] + [system]
    worker = _run_in_process(
        prompts, [5] * 4, num_slots=512, num_state_slots=16, max_running_requests=8
    )
    first = worker.extends["r0"][0]
    assert sorted(n for n, _ in first.snapshots) == [49, 50, 55]  # system[:-1], system, end-1
    assert [worker.first_prefix[f"r{i}"] for i in range(4)] == [0, 50, 50, 49]
