"""Cache salts and cache_control priority prefixes through the scheduler, driven in-process
step by step (tests/test_scheduler_policy.py plays the worker)."""

from __future__ import annotations

from common.cache_salt import salt_namespace
from common.messages import GenerateReq, SamplingParams
from scheduler.scheduler import Scheduler
from tests.test_scheduler_policy import make_scheduler, run_step

PROMPT = list(range(10, 50))


def serve(s: Scheduler, rid: str, prompt: list[int], **fields) -> int:
    """Run one request to its end; its cached_tokens."""
    sampling = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    s.on_request(GenerateReq(rid, prompt, sampling, **fields))
    outs = []
    while s.busy:
        run_step(s)
        outs += [o for o in s.take_outputs() if o.rid == rid]
    assert outs and outs[-1].finish_reason == "length"
    return outs[0].cached_tokens


def test_salted_requests_share_only_within_their_salt():
    s = make_scheduler()
    assert serve(s, "a1", PROMPT, cache_salt="a") == 0
    assert serve(s, "b1", PROMPT, cache_salt="b") == 0
    assert serve(s, "plain", PROMPT) == 0
    assert serve(s, "a2", PROMPT, cache_salt="a") == len(PROMPT) - 1
    assert serve(s, "plain2", PROMPT) == len(PROMPT) - 1
    s.check_invariants()


def test_evicted_salted_paths_carry_their_namespace():
    s = make_scheduler()
    serve(s, "a", PROMPT, cache_salt="a")
    s.take_evicted()
    s.kv.tree.evict(10_000)
    assert s.take_evicted() == [[salt_namespace("a")]]


def test_priority_prefix_is_evicted_last():
    s = make_scheduler()
    marked, other = PROMPT, list(range(100, 140))
    serve(s, "marked", marked, priority_prefix_len=30)
    serve(s, "other", other)  # more recent, yet unmarked: it goes first
    # each request cached its prompt and its first output token; the unmarked tokens go
    tail = len(marked) + 1 - 30
    assert s.kv.tree.evict(tail) == tail  # the older: marked's unmarked tail
    assert s.kv.tree.evict(1) == 1 and s.kv.tree.evict(len(other)) == len(other)
    assert serve(s, "marked2", marked) == 30
    assert serve(s, "other2", other) == 0
    s.check_invariants()


def test_priority_prefix_beyond_the_prompt_is_cut_to_it():
    s = make_scheduler()
    serve(s, "m", PROMPT[:5], priority_prefix_len=10**6)
    assert s.kv.tree.match_prefix(PROMPT[:5]).last_node.priority
