"""Routing policies: which replica a request goes to (`--routing-policy`).

- `cache_aware` (SGLang gateway's design): per replica an `ApproxTree` of the prompts sent
  to it. When load is balanced, the request goes to the replica whose tree matches the
  longest prefix of its prompt if that covers more than `--cache-threshold` of it
  (reason `cache_hit`), else to the replica with the smallest tree, which has the most room
  for a new prefix (`cache_miss`). Load is imbalanced when the busiest and the idlest
  replica differ by more than `balance_abs` requests AND the busiest has more than
  `balance_rel` times the idlest's: then the least-loaded replica gets it (`imbalanced`).
  The chosen replica's tree takes in the prompt, so one conversation (one prefix) sticks,
  and gives up what the replica reports it evicted (`CacheEvicted`), so a prefix that
  replica no longer holds does not draw requests there.
- `round_robin`: the next replica in turn. `least_load`: the fewest requests in flight.

A request with a routing key (the Responses API's `prompt_cache_key`) goes to the replica
`by_key` picks for that key, whatever the policy (reason `route_key`): rendezvous hashing,
so the same key finds the same replica, and only the keys of a replica that goes away move.

Load is the router's own count of requests in flight per replica (exact, no message).
A policy sees only the replicas that serve now; with one of them, it is chosen (reason
`single`) but a cache-aware tree still learns the prompt.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence

from router.approx_tree import ApproxTree
from router.replicas import Replica

POLICIES = ("cache_aware", "round_robin", "least_load")
DEFAULT_TREE_TOKENS = 1 << 20  # a tree's bound until its replica reports its pool size


class RoundRobin:
    name = "round_robin"

    def __init__(self):
        self._turn = itertools.count()

    def choose(self, candidates: Sequence[Replica], tokens: list[int]) -> tuple[Replica, str]:
        return candidates[next(self._turn) % len(candidates)], self.name

    def reset(self, replica: Replica) -> None:
        pass

    def learn(self, replica: Replica, tokens: list[int]) -> None:
        """The prompt went to `replica` (chosen by its routing key)."""

    def evicted(self, replica: Replica, paths: list[list[int]]) -> None:
        pass


class LeastLoad(RoundRobin):
    name = "least_load"

    def choose(self, candidates: Sequence[Replica], tokens: list[int]) -> tuple[Replica, str]:
        return min(candidates, key=lambda r: r.load), self.name


class CacheAware:
    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.5, balance_abs: int = 32,
                 balance_rel: float = 1.0001):  # fmt: skip
        self.cache_threshold = cache_threshold
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.trees: dict[str, ApproxTree] = {}

    def tree(self, replica: Replica) -> ApproxTree:
        tree = self.trees.get(replica.id)
        if tree is None:
            tree = self.trees[replica.id] = ApproxTree(DEFAULT_TREE_TOKENS)
        if replica.ready is not None:  # the real cache cannot hold more than its pool
            tree.max_tokens = replica.ready.num_slots
        return tree

    def choose(self, candidates: Sequence[Replica], tokens: list[int]) -> tuple[Replica, str]:
        chosen, reason = self._pick(candidates, tuple(tokens))
        self.learn(chosen, tokens)
        return chosen, reason

    def learn(self, replica: Replica, tokens: list[int]) -> None:
        self.tree(replica).insert(tuple(tokens))

    def _pick(self, candidates: Sequence[Replica], key: tuple[int, ...]) -> tuple[Replica, str]:
        if len(candidates) == 1:
            return candidates[0], "single"
        loads = [r.load for r in candidates]
        low, high = min(loads), max(loads)
        if high - low > self.balance_abs and high > low * self.balance_rel:
            return candidates[loads.index(low)], "imbalanced"
        matched = [self.tree(r).match(key) for r in candidates]
        best = max(matched)
        if key and best / len(key) > self.cache_threshold:
            return candidates[matched.index(best)], "cache_hit"
        return min(candidates, key=lambda r: (self.tree(r).size, r.load)), "cache_miss"

    def reset(self, replica: Replica) -> None:
        """The replica restarted: its cache is empty."""
        tree = self.trees.get(replica.id)
        if tree is not None:
            tree.clear()

    def evicted(self, replica: Replica, paths: list[list[int]]) -> None:
        """The replica's cache dropped these (common.messages.CacheEvicted)."""
        tree = self.trees.get(replica.id)
        if tree is not None:
            for path in paths:
                tree.remove(path)


def by_key(candidates: Sequence[Replica], key: str) -> Replica:
    """The replica of highest hash of (key, replica id): the same one for a key as long
    as it serves (rendezvous hashing)."""

    def weight(replica: Replica) -> bytes:
        return hashlib.blake2b(f"{key}\0{replica.id}".encode(), digest_size=8).digest()

    return max(candidates, key=weight)


def make_policy(name: str, cache_threshold: float = 0.5, balance_abs: int = 32,
                balance_rel: float = 1.0001):  # fmt: skip
    if name == "cache_aware":
        return CacheAware(cache_threshold, balance_abs, balance_rel)
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    raise ValueError(f"unknown routing policy {name!r}")
