"""The scheduler's side of n-gram speculation, against the scripted worker.

The scripted model repeats the last `period` tokens of requests that have one (so
their n-gram drafts are accepted) and hashes the sequence for the others (drafts fail);
the worker accepts a draft exactly where it equals the model's next token. Every step is
checked against the slot contract (draft slots fresh, accepted ones holding the right
token's KV) and the scheduler runs with --debug-invariants: rejected drafts' slots are
freed, the trie only holds accepted tokens.
"""

from __future__ import annotations

import random

from common.messages import DecodeBatch
from scheduler.speculation import NgramIndex
from tests.scripted_worker import toks


def _spec_harness(make_harness, num_slots: int, k: int = 4):
    h = make_harness(num_slots, speculative_algorithm="ngram", speculative_num_draft_tokens=k)
    sent = []
    h.on_worker(lambda m: isinstance(m, DecodeBatch) and bool(sent.append(m)) and False)
    return h, sent


def test_drafts_are_verified_and_outputs_unchanged(make_harness):
    h, sent = _spec_harness(make_harness, 2048)
    rng = random.Random(3)
    shared = toks(rng, 30)
    for i in range(12):
        prompt = (shared if i % 3 == 0 else []) + toks(rng, rng.randrange(3, 20))
        period = rng.choice([None, 3, 5]) if i % 2 else None
        stops = [] if i != 5 else h.model.preview(prompt, 30)[-1:]
        h.submit(f"s{i}", prompt, rng.randrange(10, 50), period=period, stop_token_ids=stops,
                 eos_at=rng.choice([None, 25]))  # fmt: skip
    h.wait_idle(timeout=20)
    h.verify()  # every output equals the scripted model's, with its stop rules
    drafted = [d for m in sent for d in m.drafts if d]
    assert drafted and all(len(d) <= 4 for d in drafted)
    assert h.results["s1"].completion_tokens == len(h.results["s1"].tokens)


def test_tiny_pool_with_drafts_evicts_and_retracts(make_harness):
    h, sent = _spec_harness(make_harness, 128, k=6)
    rng = random.Random(4)
    for i in range(16):
        h.submit(f"t{i}", toks(rng, rng.randrange(4, 30)), rng.randrange(20, 60),
                 period=rng.choice([2, 4, None]))  # fmt: skip
    stats = h.wait_idle(timeout=30)
    h.verify()
    assert stats.retracted_requests > 0 and stats.evicted_tokens > 0, stats
    assert any(any(m.drafts) for m in sent)


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there(make_harness):
    h, sent = _spec_harness(make_harness, 1024)
    # the model continues 6 7 5 6 7 ...; the drafts "7 5 6 7" are all accepted, and the
    # stop token 7 is the first of them
    h.submit("stop", [5, 6, 7] * 4 + [5], 20, period=3, stop_token_ids=[7])
    h.submit("eos", [5, 6, 7] * 4 + [5], 20, period=3, eos_at=4)
    h.wait_idle()
    h.verify()
    assert h.results["stop"].tokens == [6, 7] and h.results["stop"].finish == "stop"
    assert any(m.drafts for m in sent)
    assert h.final_stats().token_usage == 0


def test_no_drafts_past_max_new_tokens_or_for_penalised_rows(make_harness):
    h, sent = _spec_harness(make_harness, 1024, k=8)
    h.submit("short", [5, 6, 7] * 4, 3, period=3)  # 3 tokens: drafts of at most 1 after the first
    h.submit("pen", [5, 6, 7] * 4, 12, period=3, repetition_penalty=1.2)
    h.wait_idle()
    h.verify()
    for m in sent:
        rows = dict(zip(m.rids, m.drafts or [[] for _ in m.rids]))
        assert not rows.get("pen")
        assert len(rows.get("short", [])) <= 1


def test_ngram_index_proposes_the_latest_continuation():
    idx = NgramIndex()
    idx.extend([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3])
    assert idx.propose(3) == [4, 5, 1]  # the latest "1 2 3" was followed by 4 5 1
    idx = NgramIndex()
    idx.extend([7, 8, 7, 8])
    assert idx.propose(5) == [7, 8, 7, 8, 7]  # a loop continues past the history's end
    idx = NgramIndex()
    idx.extend([1, 2, 3, 4])
    assert idx.propose(4) == []


def test_draft_model_rows_draft_after_their_guesses_hit_and_stop_when_drafts_fail():
    from common.messages import SamplingParams
    from scheduler.request import Req
    from scheduler.speculation import SHADOW_HITS, WINDOW, DraftModelSpeculation

    spec = DraftModelSpeculation(4)
    row = Req("a", [1, 2, 3], SamplingParams(temperature=0, max_new_tokens=100))
    pen = Req("p", [1, 2, 3], SamplingParams(temperature=0, repetition_penalty=1.2))
    short = Req("s", [1, 2, 3], SamplingParams(temperature=0, max_new_tokens=3))
    reqs = [row, pen, short]
    assert spec.drafts(reqs, 4096) == [[], [], []]  # in shadow at first
    for r in reqs:
        spec.observe(r, 0, 0, 7, 8)  # the draft guessed 8, the model made 7
    for _ in range(SHADOW_HITS):
        assert spec.drafts(reqs, 4096) == [[], [], []]
        for r in reqs:
            spec.observe(r, 0, 0, 7, 7)
    assert [len(d) for d in spec.drafts(reqs, 4096)] == [4, 0, 2]  # slots only, in room
    assert [len(d) for d in spec.drafts([row], 6)] == [2]  # the context's end
    assert spec.active([row])
    for step in range(WINDOW):  # one draft in four kept: below LOW_ACCEPTANCE
        spec.observe(row, 4, 1 if step == 0 else 0, 0)
    assert spec.drafts([row], 4096) == [[]] and not spec.active([row])


def _drafting_share(make_harness, verify_cost: float, looping: int, others: int) -> float:
    """The share of decode steps that carried drafts, on a scripted machine where a
    verify step costs `verify_cost` times a plain one, for `looping` rows whose drafts
    hold decoding beside `others` whose drafts fail."""
    h, sent = _spec_harness(make_harness, 4096)
    h.worker.step_seconds = lambda rows, columns: 0.001 * (1 if columns == 1 else verify_cost)
    rng = random.Random(9)
    for i in range(looping + others):
        period = 3 if i < looping else None
        h.submit(f"m{i}", toks(rng, 12), 160, period=period, ignore_eos=True)
    h.wait_idle(timeout=30)
    h.verify()  # outputs unchanged whatever is drafted
    full = [m for m in sent if len(m.rids) == looping + others]
    return sum(bool(any(m.drafts)) for m in full) / len(full)


def test_one_looping_row_does_not_make_a_compute_bound_batch_verify(make_harness):
    """At 8 rows on a machine where a verify step costs 3 plain ones, one row's drafts
    (up to 5 tokens of the batch's 12) do not pay: after the two steps that measure a
    verify step, drafts go out only on the retries (1 in 32)."""
    assert _drafting_share(make_harness, 3.0, looping=1, others=7) < 0.15
    # where a verify step costs what a plain one does, the same row drafts all along
    assert _drafting_share(make_harness, 1.0, looping=1, others=7) > 0.5


def test_rows_whose_drafts_pay_keep_drafting_on_a_compute_bound_machine(make_harness):
    """The same machine: 8 looping rows (8 x 4 drafts kept) and one row alone (1 + 4
    tokens for 3 plain steps' time) pay for the verify step."""
    assert _drafting_share(make_harness, 3.0, looping=8, others=0) > 0.5
    assert _drafting_share(make_harness, 3.0, looping=1, others=0) > 0.5


def test_step_cost_learns_each_shape_and_retries_a_refused_one():
    from scheduler.step_cost import MIN_SAMPLES, RETRY_AFTER, StepCost

    cost = StepCost()
    assert cost.pays(8, 5, 9.0)  # a worker that reports no timings: never refused
    cost.record(8, 5, None)
    assert cost.pays(8, 5, 9.0)
    for _ in range(MIN_SAMPLES):  # the first of a shape is a warm-up, not counted
        cost.record(8, 1, 0.010)
    assert not cost.pays(8, 5, 99.0)  # plain steps first: their cost is what drafts beat
    cost.record(8, 1, 0.500)  # a step that also admitted rows: the median ignores it
    cost.record(8, 1, 0.010)
    assert cost.seconds(8, 1) == 0.010
    assert cost.pays(8, 5, 9.0)  # a verify step's cost is learnt by drafting
    for _ in range(MIN_SAMPLES + 1):
        cost.record(8, 5, 0.020)
    assert cost.pays(8, 5, 16.0) and not cost.pays(8, 5, 15.9)  # 2x the time: 2x the tokens
    assert not cost.pays(4, 5, 99.0)  # another batch size is its own shape
    refusals = [cost.pays(8, 5, 9.0) for _ in range(4 * RETRY_AFTER)]
    retries = [i for i, ok in enumerate(refusals) if ok]
    assert retries == [RETRY_AFTER - 2, 3 * RETRY_AFTER - 2]  # then twice as long a wait
