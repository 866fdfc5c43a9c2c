"""The router's approximate prefix tree and its routing policies, on their own.

The tree is checked against a brute-force model (the longest common prefix with any
sequence inserted), and its bound and LRU order; the policies on replicas whose load and
state the tests set.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from common.messages import SchedulerReady
from router.approx_tree import PRUNE_TO, ApproxTree
from router.replicas import Replica, ReplicaSet
from router.routing import CacheAware, LeastLoad, RoundRobin, by_key, make_policy
from scheduler.memory_pool import TokenToKVPoolAllocator
from scheduler.radix_cache import RadixCache

# small alphabets, so that sequences share prefixes and edges split
SEQS = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=12).map(tuple), max_size=30)


def _lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _trie_size(seqs) -> int:
    """Tokens in an uncompressed trie of `seqs`: distinct non-empty prefixes."""
    return len({s[:i] for s in seqs for i in range(1, len(s) + 1)})


@settings(max_examples=300, deadline=None)
@given(SEQS, st.lists(st.integers(0, 3), max_size=14).map(tuple))
def test_match_is_the_longest_common_prefix_with_anything_inserted(seqs, query):
    tree = ApproxTree(max_tokens=10**9)
    for s in seqs:
        tree.insert(s)
    assert tree.match(query) == max((_lcp(s, query) for s in seqs), default=0)
    assert tree.size == _trie_size(seqs)


@settings(max_examples=300, deadline=None)
@given(SEQS, st.integers(1, 40))
def test_pruning_keeps_the_bound_and_the_newest_insert(seqs, bound):
    tree = ApproxTree(max_tokens=bound)
    for s in seqs:
        tree.insert(s)
        assert tree.size <= bound
        # what was just inserted is the most recent use: pruning cuts it last, and only
        # down to PRUNE_TO of the bound
        assert tree.match(s) >= min(len(s), int(bound * PRUNE_TO))
    for s in seqs:  # never more than a brute-force match, whatever was cut
        assert tree.match(s) <= len(s)


def test_lru_leaf_goes_first_and_a_cut_leaf_keeps_its_head():
    tree = ApproxTree(max_tokens=100)
    old, new = tuple(range(10, 40)), tuple(range(50, 80))
    tree.insert(old)
    tree.insert(new)
    tree.prune(45)  # 60 tokens held: 15 must go, all from the older leaf's tail
    assert tree.size == 45
    assert tree.match(new) == 30 and tree.match(old) == 15
    tree.insert(old)  # now `old` is the newer one
    tree.prune(20)
    assert tree.match(old) == 20 and tree.match(new) == 0
    tree.clear()
    assert tree.size == 0 and tree.match(old) == 0


def _without(seq, path):
    """What the replica still holds of `seq` once everything starting with `path` went."""
    return seq[: len(path) - 1] if seq[: len(path)] == path else seq


@settings(max_examples=300, deadline=None)
@given(SEQS, st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8).map(tuple), max_size=6),
       st.lists(st.integers(0, 3), max_size=14).map(tuple))  # fmt: skip
def test_removing_an_evicted_path_cuts_exactly_what_starts_with_it(seqs, paths, query):
    tree = ApproxTree(max_tokens=10**9)
    for s in seqs:
        tree.insert(s)
    held = list(seqs)
    for path in paths:
        tree.remove(path)
        held = [_without(s, path) for s in held]
        assert tree.size == sum(len(n.edge) for n in tree._nodes()) == _trie_size(held)
    assert tree.match(query) == max((_lcp(s, query) for s in held), default=0)


@settings(max_examples=200, deadline=None)
@given(SEQS, st.integers(1, 60), st.lists(st.integers(0, 3), max_size=14).map(tuple))
def test_the_scheduler_trie_s_evicted_paths_make_the_router_tree_exact(seqs, evict, query):
    """A RadixCache that reports its evictions and an ApproxTree of the same inserts: after
    the tree removes the reported paths, both match every query alike."""
    allocator = TokenToKVPoolAllocator(2048)
    cache = RadixCache(allocator, report_evictions=True)
    tree = ApproxTree(max_tokens=10**9)
    for s in seqs:
        if s:  # (slots of a head already cached are not freed: the pool is big enough)
            cache.insert(list(s), allocator.alloc(len(s)))
        tree.insert(s)
    cache.evict(evict)
    for path in cache.evicted_paths:
        tree.remove(path)
    assert tree.match(query) == len(cache.match_prefix(query).slot_ids)
    assert tree.size == cache.total_size()


def _replicas(n: int, slots: int = 10_000) -> list[Replica]:
    out = [Replica(f"r{i}", f"test://{i}", link=None) for i in range(n)]
    for r in out:
        r.state, r.ready = "ready", SchedulerReady(slots, 64, 4096, "qwen3")
    return out


def _groups(n_groups: int, per_group: int, seed: int = 0) -> list[tuple[int, list[int]]]:
    """(group, prompt): a long shared prefix per group, a short own suffix, shuffled."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(512) for _ in range(200)] for _ in range(n_groups)]
    out = [(g, prefixes[g] + [rng.randrange(512) for _ in range(16)])
           for g in range(n_groups) for _ in range(per_group)]  # fmt: skip
    rng.shuffle(out)
    return out


def test_cache_aware_sticks_each_group_to_one_replica_and_spreads_the_groups():
    replicas = _replicas(2)
    policy = CacheAware()
    landed: dict[int, set[str]] = {}
    reasons = []
    for group, prompt in _groups(4, 8):
        replica, reason = policy.choose(replicas, prompt)
        landed.setdefault(group, set()).add(replica.id)
        reasons.append(reason)
    assert all(len(ids) == 1 for ids in landed.values()), landed
    assert {next(iter(ids)) for ids in landed.values()} == {"r0", "r1"}  # both used
    assert reasons.count("cache_miss") == 4 and reasons.count("cache_hit") == 28


def test_round_robin_splits_the_groups():
    replicas = _replicas(2)
    policy = RoundRobin()
    landed: dict[int, set[str]] = {}
    for group, prompt in _groups(4, 8):
        landed.setdefault(group, set()).add(policy.choose(replicas, prompt)[0].id)
    assert any(len(ids) == 2 for ids in landed.values())


def test_imbalance_overrides_the_cache_and_below_the_threshold_the_emptier_tree_wins():
    r0, r1 = replicas = _replicas(2)
    policy = CacheAware(cache_threshold=0.5, balance_abs=4, balance_rel=1.5)
    prompt = list(range(100))
    assert policy.choose(replicas, prompt) == (r0, "cache_miss")  # equal trees: r0
    r0.in_flight = {f"x{i}" for i in range(6)}  # 6 vs 0: more than 4 apart and > 1.5x
    assert policy.choose(replicas, prompt) == (r1, "imbalanced")
    r1.in_flight = {"y"}  # 6 vs 1: more than 4 apart, and 6 > 1.5: still imbalanced
    assert policy.choose(replicas, prompt)[1] == "imbalanced"
    r1.in_flight = {"y", "z"}  # 6 vs 2: 4 apart, not more: balanced, cache decides
    assert policy.choose(replicas, prompt)[1] == "cache_hit"
    # a prompt sharing half of its tokens with r0's tree is not a hit (> 0.5 needed)
    half = list(range(50)) + list(range(1000, 1050))
    r0.in_flight = r1.in_flight = set()
    chosen, reason = policy.choose(replicas, half)
    assert reason == "cache_miss"
    policy.reset(r0)
    assert policy.trees["r0"].size == 0


def test_the_tree_bound_follows_the_replica_pool():
    (r0,) = _replicas(1, slots=64)
    policy = CacheAware()
    for i in range(10):
        policy.choose([r0], [i] * 50)
    assert policy.trees["r0"].size <= 64


def test_least_load_and_a_single_candidate():
    r0, r1, r2 = replicas = _replicas(3)
    r0.in_flight, r1.in_flight = {"a", "b"}, {"c"}
    assert LeastLoad().choose(replicas, [1])[0] is r2
    assert CacheAware().choose([r1], [1, 2]) == (r1, "single")
    assert make_policy("least_load").name == "least_load"


def test_a_routing_key_keeps_its_replica_and_only_a_lost_replica_s_keys_move():
    """prompt_cache_key routing: the same key, the same replica; keys spread over the
    replicas; when one goes away, only the keys it had move (rendezvous hashing)."""
    replicas = _replicas(3)
    keys = [f"session-{i}" for i in range(90)]
    before = {k: by_key(replicas, k) for k in keys}
    assert all(by_key(replicas[::-1], k) is before[k] for k in keys)  # order plays no part
    counts = [sum(r is before[k] for k in keys) for r in replicas]
    assert min(counts) >= 15, counts
    lost = replicas[1]
    after = {k: by_key([replicas[0], replicas[2]], k) for k in keys}
    assert all(after[k] is before[k] for k in keys if before[k] is not lost)
    policy = CacheAware()  # the key's replica learns the prompt, as a policy's choice does
    policy.learn(replicas[2], [1, 2, 3])
    assert policy.trees["r2"].match((1, 2, 3)) == 3


def test_replica_set_prefers_replicas_heard_from_lately():
    r0, r1 = _replicas(2)
    replicas = ReplicaSet([r0, r1])
    r1.last_heard -= 10  # silent: no new requests while r0 answers
    assert replicas.serving() == [r0]
    r0.last_heard -= 10  # both silent (a loaded machine): every ready one serves
    assert replicas.serving() == [r0, r1]
    r0.state = "down"
    assert replicas.serving() == [r1]


def test_multi_tenant_workload_interleaves_tenants_with_long_shared_prefixes(tiny_model):
    from benchmarks.workloads import PromptFactory, multi_tenant_sessions
    from router.model_files import load_tokenizer

    f = PromptFactory(load_tokenizer(tiny_model), seed=3)
    sessions = multi_tenant_sessions(f, tenants=4, requests_per_tenant=3, system_len=64,
                                     question_len=8, output_len=2)  # fmt: skip
    tenants = [s.labels[0] for s in sessions]
    rounds = [tenants[i : i + 4] for i in range(0, 12, 4)]
    assert all(sorted(r) == sorted({"tenant0", "tenant1", "tenant2", "tenant3"}) for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1  # each round in its own order
    by_tenant: dict[str, list[list[int]]] = {}
    for s in sessions:
        by_tenant.setdefault(s.labels[0], []).append(s.turns[0].ids)
    for prompts in by_tenant.values():
        assert all(p[:64] == prompts[0][:64] and len(p) == 72 for p in prompts)
    heads = {prompts[0][:64][-8:] == other[0][:64][-8:] for other in by_tenant.values()}
    assert heads == {True, False}  # tenants' prefixes differ (but for their own)


def test_dashboard_has_a_per_replica_row():
    import json
    from pathlib import Path

    board = json.loads((Path(__file__).parents[1] / "deploy/grafana-dashboard.json").read_text())
    titles = [p["title"] for p in board["panels"]]
    assert "Replicas (--dp-size)" in titles
    exprs = " ".join(t["expr"] for p in board["panels"] for t in p.get("targets", []))
    assert "sum by (replica) (rate(radix_mlx_cached_tokens_total" in exprs
    assert "sum by (replica) (radix_mlx_num_running_requests" in exprs
    assert "sum by (replica, le) (rate(radix_mlx_time_to_first_token_seconds_bucket" in exprs
    assert "sum by (policy, reason) (rate(radix_mlx_routing_decisions_total" in exprs
