"""The agent-sessions workload's generator (benchmarks.agent_sessions), without a server:
each turn is the previous prompt, its answer and something new; sessions share only the
system prompt; the pool the servers get is the requested share of the working set,
counted here from the prompts themselves. The figures are the benchmark's."""

from __future__ import annotations

import re

import pytest

from benchmarks.agent_sessions import (
    BIG_POOL,
    DEFAULTS,
    DISK_TIER,
    NO_TIER,
    WORKLOAD,
    check_fits,
    pool_tokens,
    server_flags,
    suite,
    working_set_tokens,
)
from benchmarks.records import WorkloadSpec
from benchmarks.serving import load_tokenizer
from benchmarks.workloads import PromptFactory, build_sessions

PARAMS = dict(DEFAULTS, sessions=5, turns=4, system_len=24, task_len=40, result_len=16,
              message_len=6, output_len=3, pool_multiple=4.0)  # fmt: skip


@pytest.fixture(scope="module")
def factory(tiny_model):
    return PromptFactory(load_tokenizer(tiny_model), "agent-sessions-test")


def _run_offline(f: PromptFactory, params: dict) -> list[list[list[int]]]:
    """Every session's sequence of prompts and answers, composed as the load generator
    composes them (benchmarks.workloads.run_session), with word tokens as answers."""
    out = []
    for s in build_sessions(WorkloadSpec(WORKLOAD, params), f):
        prompt, answer = s.turns[0], f.piece(s.output_lens[0])
        seqs = [prompt.ids + answer.ids]
        for user, out_len in zip(s.turns[1:], s.output_lens[1:]):
            prompt = f.continued(prompt, answer.ids, answer.text, user, as_text=False)
            answer = f.piece(out_len)
            seqs.append(prompt.ids + answer.ids)
        out.append(seqs)
    return out


def _distinct_tokens(seqs: list[list[int]]) -> int:
    """Nodes of a token trie over `seqs`: what a cache needs to hold them all."""
    root: dict = {}
    count = 0
    for seq in seqs:
        node = root
        for t in seq:
            if t not in node:
                node[t] = {}
                count += 1
            node = node[t]
    return count


def test_turns_grow_by_answer_and_new_piece_over_the_same_prefix(factory):
    sessions = _run_offline(factory, PARAMS)
    assert len(sessions) == 5 and all(len(s) == 4 for s in sessions)
    out = PARAMS["output_len"]
    for seqs in sessions:
        first = seqs[0]
        assert len(first) == PARAMS["system_len"] + PARAMS["task_len"] + out
        grown = [len(b) - len(a) for a, b in zip(seqs, seqs[1:])]
        # a tool result, then a user message, alternately, each with its answer
        assert grown == [16 + out, 6 + out, 16 + out]
        for a, b in zip(seqs, seqs[1:]):
            assert b[: len(a)] == a  # the whole previous turn and its answer come again
    system = sessions[0][0][: PARAMS["system_len"]]
    tasks = {tuple(s[0][: PARAMS["system_len"] + PARAMS["task_len"]]) for s in sessions}
    assert all(s[0][: PARAMS["system_len"]] == system for s in sessions)
    assert len(tasks) == 5  # past the shared system prompt, every session is its own


def test_the_pool_is_the_requested_share_of_the_working_set(factory):
    last_turns = [seqs[-1] for seqs in _run_offline(factory, PARAMS)]
    distinct = _distinct_tokens(last_turns)
    assert working_set_tokens(PARAMS) == distinct
    for multiple in (2.0, 4.0):
        params = dict(PARAMS, pool_multiple=multiple)
        assert distinct / pool_tokens(params) == pytest.approx(multiple, rel=0.01)
    spec = WorkloadSpec(WORKLOAD, PARAMS)
    assert server_flags(DISK_TIER, spec)[:2] == ["--max-total-tokens", str(pool_tokens(PARAMS))]
    assert "--kv-disk-block-tokens" in server_flags(DISK_TIER, spec)
    assert server_flags(NO_TIER, spec) == ["--max-total-tokens", str(pool_tokens(PARAMS))]
    assert int(server_flags(BIG_POOL, spec)[1]) >= distinct  # nothing is ever evicted


def test_a_pool_too_small_for_the_running_requests_is_refused():
    check_fits(PARAMS, 1)  # one running request of up to 114 tokens, a pool of 119
    with pytest.raises(ValueError, match="do not fit a pool of"):
        check_fits(PARAMS, 2)
    (load,) = suite()
    check_fits(load.spec.params, load.concurrencies[0])  # the default suite fits


@pytest.mark.slow
def test_the_disk_tier_server_gets_its_pool_and_directory(tiny_model, tmp_path):
    """One real server of the suite, radix-mlx-disk-tier, on a load sized for the tiny
    model: the benchmark gives it the workload's small pool and a tier directory, and
    the sessions' later turns come back from disk."""
    from benchmarks.serving import main

    sizes = dict(sessions=6, turns=3, system_len=16, task_len=96, result_len=64,
                 message_len=16, output_len=4, pool_multiple=4.0)  # fmt: skip
    argv = ["--workload", WORKLOAD, "--backend", DISK_TIER, "--model-path", tiny_model,
            "--max-concurrency", "1", "--output-dir", str(tmp_path), "--no-plots",
            "--no-progress", "--result-file", str(tmp_path / "serving.jsonl")]  # fmt: skip
    for name, value in sizes.items():
        argv += ["--as-" + name.replace("_", "-"), str(value)]
    assert main(argv) == 0
    log = (tmp_path / "logs" / f"{DISK_TIER}.log").read_text()
    assert f"KV pool: {pool_tokens(sizes)} tokens" in log  # a quarter of the working set
    assert "kv disk tier:" in log
    loaded = [int(n) for n in re.findall(r"#disk-cached-token: (\d+)", log)]
    assert sum(loaded) >= 64 * 6  # each session's history, evicted from the pool, came back
