"""benchmarks.serving against a real radix-mlx on the tiny model: the tool works and its
numbers are internally consistent (every request succeeded, token counts match the
requests, throughputs match totals over duration). No comparison with mlx_lm.server here:
that is the benchmark's job, not a test's."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from benchmarks.plots import save_plots
from benchmarks.records import RequestResult, RunResult, WorkloadSpec
from benchmarks.report import REFERENCE, comparison_table, compute_metrics
from benchmarks.serving import (
    WARM_UP_SEED,
    Endpoint,
    PlannedRun,
    bench_run,
    load_tokenizer,
    main,
    parse_args,
    plan_runs,
    warm_up,
)
from benchmarks.summary import Target, check_targets, median_over_repeats
from benchmarks.workloads import PromptFactory, build_sessions

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(tiny_model)


@pytest.fixture(scope="module")
def endpoint(tiny_server) -> Endpoint:
    return Endpoint("radix-mlx", tiny_server.url, tiny_server.zmq_address)


def _run(endpoint, tokenizer, spec, transport="http", **kw) -> tuple[RunResult, dict]:
    run = asyncio.run(bench_run(endpoint, transport, spec, tokenizer, progress=False, **kw))
    return run, compute_metrics(run)


def _check_consistent(run: RunResult, m: dict) -> None:
    """What every run must satisfy, whatever the workload."""
    assert m["failed"] == 0, m["errors"]
    assert m["completed"] == len(run.requests) > 0
    for r in run.requests:
        assert r.ok and not r.error
        assert r.output_len == r.requested_len == r.streamed_tokens == len(r.output_ids)
        assert r.reported_prompt_len == r.prompt_len
        assert 0 < r.ttft <= r.latency
        assert len(r.itls) <= r.output_len - 1
        assert 0 <= r.cached_tokens < r.prompt_len
    assert m["short_outputs"] == m["prompt_len_mismatches"] == m["stream_count_mismatches"] == 0
    assert m["total_output_tokens"] == sum(r.requested_len for r in run.requests)
    assert m["total_input_tokens"] == sum(r.prompt_len for r in run.requests)
    dur = run.duration
    assert dur > 0
    assert m["output_throughput"] == pytest.approx(m["total_output_tokens"] / dur)
    assert m["input_throughput"] == pytest.approx(m["total_input_tokens"] / dur)
    assert m["total_throughput"] == pytest.approx(m["input_throughput"] + m["output_throughput"])
    assert m["request_throughput"] == pytest.approx(len(run.requests) / dur)
    assert min(m["output_throughput"], m["input_throughput"], m["median_ttft_ms"]) > 0
    assert m["p99_e2e_ms"] >= m["median_e2e_ms"] >= m["median_ttft_ms"]
    assert m["p99_e2e_ms"] <= dur * 1000 + 1


def test_random_workload_over_http(endpoint, tokenizer):
    spec = WorkloadSpec("random", dict(num_prompts=8, input_len=48, output_len=12, range_ratio=0.5))
    run, m = _run(endpoint, tokenizer, spec, max_concurrency=4)
    _check_consistent(run, m)
    assert all(24 <= r.prompt_len <= 48 and 6 <= r.requested_len <= 12 for r in run.requests)
    assert len({r.prompt_len for r in run.requests}) > 1  # the range ratio varies lengths


def test_shared_prefix_workload_shares_the_prefix(endpoint, tokenizer):
    params = dict(groups=2, prompts_per_group=4, system_len=128, question_len=16, output_len=8)
    run, m = _run(endpoint, tokenizer, WorkloadSpec("generated-shared-prefix", params))
    _check_consistent(run, m)
    assert len(run.requests) == 8
    assert {r.prompt_len for r in run.requests} == {144}
    assert m["cached_share"] > 0  # the server's cached_tokens reach the report


def test_warm_up_runs_the_loads_first_wave_on_prompts_of_its_own(endpoint, tokenizer):
    """Before a load, its first wave: the first turns of as many of its sessions as it runs
    at once, the load's shapes on other prompts, so that the load still computes each of
    its own prefixes."""
    params = dict(groups=3, prompts_per_group=3, system_len=96, question_len=8, output_len=3)
    load = PlannedRun("radix-mlx", WorkloadSpec("generated-shared-prefix", params), 4)
    asyncio.run(warm_up(endpoint, "http", tokenizer, 1, load))
    # the same wave again: every prompt of it is now cached but its last token
    again, _ = _run(endpoint, tokenizer, load.spec, max_concurrency=4, seed=WARM_UP_SEED, wave=4)
    assert [r.prompt_len for r in again.requests] == [104] * 4
    assert all(r.cached_tokens == r.prompt_len - 1 for r in again.requests)
    run, m = _run(endpoint, tokenizer, load.spec, max_concurrency=4)
    _check_consistent(run, m)
    assert len(run.requests) == 9
    assert sum(r.cached_tokens < 96 for r in run.requests) >= 3  # each group's prefix, once
    # a peer's server gets no wave (its prefix cache would hold it during the load)
    params = dict(groups=2, prompts_per_group=2, system_len=80, question_len=8, output_len=2)
    peer_load = PlannedRun("mlx-lm", WorkloadSpec("generated-shared-prefix", params), 2)
    asyncio.run(warm_up(endpoint, "http", tokenizer, 1, peer_load))
    wave, _ = _run(
        endpoint, tokenizer, peer_load.spec, max_concurrency=2, seed=WARM_UP_SEED, wave=2
    )
    assert any(r.cached_tokens < 80 for r in wave.requests)


def test_multi_turn_carries_the_real_history(endpoint, tokenizer):
    params = dict(conversations=3, turns=3, user_len=16, output_len=8)
    run, m = _run(endpoint, tokenizer, WorkloadSpec("multi-turn", params), max_concurrency=3)
    _check_consistent(run, m)
    by_label = {}
    for r in run.requests:
        by_label.setdefault(r.label, set()).add(r.prompt_len)
    # turn k = k user messages and k - 1 answers
    assert by_label == {"turn1": {16}, "turn2": {40}, "turn3": {64}}
    later = [r for r in run.requests if r.label != "turn1"]
    assert all(r.cached_tokens >= r.prompt_len - 16 - 8 for r in later)


def test_agent_workload_hits_the_cache_every_turn(endpoint, tokenizer):
    params = dict(sessions=3, turns=3, system_len=96, task_len=16, result_len=16, output_len=8)
    run, m = _run(endpoint, tokenizer, WorkloadSpec("agent", params), max_concurrency=3)
    _check_consistent(run, m)
    by_label = {}
    for r in run.requests:
        by_label.setdefault(r.label, set()).add(r.prompt_len)
    # turn k = the shared system prompt, the task, k - 1 answers and k - 1 tool results
    assert by_label == {"turn1": {112}, "turn2": {136}, "turn3": {160}}
    later = [r for r in run.requests if r.label != "turn1"]
    assert all(r.cached_tokens >= r.prompt_len - 16 - 8 for r in later)
    assert m["cached_share"] > 0.5


@pytest.mark.parametrize("backend", ["radix-mlx-chat", "radix-mlx-responses"])
def test_agent_workload_through_chat_and_responses(tiny_server, tokenizer, backend):
    """The agent sessions as chats that grow: the whole history through the chat API, or
    each new turn alone through the Responses API with previous_response_id, which hits
    the cache for the whole previous turn (its prompt and answer, as the model saw them)."""
    params = dict(sessions=2, turns=3, system_len=96, task_len=16, result_len=16, output_len=8)
    ep = Endpoint(backend, tiny_server.url)
    run, m = _run(ep, tokenizer, WorkloadSpec("agent", params), max_concurrency=2)
    assert m["failed"] == 0, m["errors"]
    assert all(r.output_len == 8 and 0 < r.ttft <= r.latency for r in run.requests)
    assert set(m["cached_share_by_label"]) == {"turn1", "turn2", "turn3"}
    turns = [run.requests[i : i + 3] for i in range(0, len(run.requests), 3)]
    for session in turns:
        assert [r.label for r in session] == ["turn1", "turn2", "turn3"]
        for prev, r in zip(session, session[1:]):
            assert r.prompt_len > prev.prompt_len + prev.output_len
            whole = prev.prompt_len + (prev.output_len if backend.endswith("responses") else 0)
            assert r.cached_tokens >= whole - 1, (prev, r)  # all but a token never computed


def test_repeat_workload_reports_the_warm_hit(endpoint, tokenizer):
    spec = WorkloadSpec("repeat", dict(length=384, output_len=4, warm_runs=2))
    run, m = _run(endpoint, tokenizer, spec)
    _check_consistent(run, m)
    cold, *warm = run.requests
    assert cold.label == "cold" and cold.cached_tokens == 0
    assert [r.label for r in warm] == ["warm", "warm"]
    assert all(382 <= r.cached_tokens <= 383 for r in warm)
    assert set(m["ttft_by_label_ms"]) == {"cold", "warm"}


def test_sdk_transport_and_poisson_arrivals(endpoint, tokenizer):
    spec = WorkloadSpec("random", dict(num_prompts=6, input_len=32, output_len=10, range_ratio=1))
    run, m = _run(endpoint, tokenizer, spec, "sdk", max_concurrency=3, request_rate=40.0)
    _check_consistent(run, m)
    assert run.transport == "sdk"
    # same seed and load: same prompts, so the same greedy outputs over HTTP
    http, _ = _run(endpoint, tokenizer, spec, max_concurrency=3, request_rate=40.0)
    assert [r.output_ids for r in http.requests] == [r.output_ids for r in run.requests]


def _cli_argv(url: str, model: str, out, tmp_path) -> list[str]:
    return [
        "--base-url",
        url,
        "--model-path",
        model,
        "--workload",
        "repeat",
        "--repeat-len",
        "96",
        "--repeat-output-len",
        "3",
        "--repeat-warm-runs",
        "1",
        "--result-file",
        str(out),
        "--output-dir",
        str(tmp_path),
        "--no-plots",
        "--no-progress",
        "--warmup-requests",
        "1",
    ]


def test_cli_writes_a_jsonl_line(tiny_server, tiny_model, tmp_path, capsys):
    out = tmp_path / "serving.jsonl"
    assert main(_cli_argv(tiny_server.url, tiny_model, out, tmp_path)) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["backend"] == "radix-mlx" and row["workload"] == "repeat"
    assert row["completed"] == 2 and row["failed"] == 0
    assert row["total_input_tokens"] == 192 and row["total_output_tokens"] == 6
    assert len(row["ttfts_ms"]) == 2
    assert "Successful requests:" in capsys.readouterr().out


def test_cli_repeats_send_other_prompts(tiny_server, tiny_model, tmp_path, capsys):
    """Each repeat draws its prompts from another seed: on the same server the second
    repeat's cold request is not a cache hit of the first's."""
    out = tmp_path / "serving.jsonl"
    assert (
        main(
            _cli_argv(tiny_server.url, tiny_model, out, tmp_path)
            + ["--repeats", "2", "--seed", "1000"]
        )
        == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["repeat"] for r in rows] == [0, 1]
    for row in rows:  # the cold request misses, the warm one hits all but its last token
        assert row["cached_share"] == pytest.approx(95 / 192)
    printed = capsys.readouterr().out
    assert "=== repeat 2 of 2" in printed and "median of 2 repeats" in printed


def test_prompts_are_identical_as_ids_and_as_text(tokenizer):
    spec = WorkloadSpec("random", dict(num_prompts=4, input_len=40, output_len=4, range_ratio=1))
    a = build_sessions(spec, PromptFactory(tokenizer, seed=3))
    b = build_sessions(spec, PromptFactory(tokenizer, seed=3))
    for sa, sb in zip(a, b):
        (p,) = sa.turns
        assert p.ids == sb.turns[0].ids and len(p.ids) == 40
        assert tokenizer.encode(p.text) == p.ids


def _fake_run(backend: str, ttft: float, out_len: int, duration: float) -> RunResult:
    reqs = [
        RequestResult(
            "request", 10, out_len, ok=True, output_len=out_len, ttft=ttft, latency=ttft + 0.1
        )
        for _ in range(4)
    ]
    spec = WorkloadSpec("random", dict(num_prompts=4))
    return RunResult(backend, "http", spec, 8, math.inf, duration, reqs)


def test_targets_take_the_median_of_each_repeats_ratio():
    """Ratios are taken within a repeat (both backends minutes apart), then the median: here
    2.0, 3.0 and 2.6. The ratio of the median throughputs (150 / 50) would say 3.0."""
    results = []
    for repeat, (ours, theirs) in enumerate([(1.0, 2.0), (2 / 3, 2.0), (1.0, 2.6)]):
        for run in (_fake_run("radix-mlx", 0.1, 20, ours), _fake_run(REFERENCE, 0.1, 20, theirs)):
            run.repeat = repeat
            results.append((run, compute_metrics(run)))
    tput = ("radix-mlx", "output_throughput"), (REFERENCE, "output_throughput")
    (line,) = check_targets(results, [Target("tput", "random", 8, *tput, ">=", 2.5)])
    assert "met" in line and ": 2.600 " in line and "repeats: 2.000, 3.000, 2.600" in line
    summary = median_over_repeats(results)
    assert len(summary) == 2
    run, m = summary[0]
    assert run.backend == "radix-mlx" and len(run.requests) == 12  # pooled over 3 repeats
    assert m["output_throughput"] == pytest.approx(80.0)  # median of 80, 120, 80
    assert m["completed"] == 4


def test_speculative_suite_measures_the_off_switch_on_the_plain_build():
    """Random prompts on the looping build loop too, and drafts would be accepted there:
    the off-switch is measured only where outputs repeat nothing."""
    args = parse_args(["--suite", "speculative"])
    assert args.preset == "medium"
    builds = {(p.spec.name, p.loop) for p in plan_runs(args)}
    assert builds == {("code-edit", True), ("random", False)}
    standard = parse_args(["--suite", "standard"])
    assert standard.preset == "small"
    assert {p.loop for p in plan_runs(standard)} == {False}


def test_comparison_ratios_and_targets():
    ours, theirs = _fake_run("radix-mlx", 0.1, 20, 1.0), _fake_run(REFERENCE, 0.4, 20, 2.0)
    results = [(ours, compute_metrics(ours)), (theirs, compute_metrics(theirs))]
    table = comparison_table(results)
    assert "2.00x" in table and "0.25x" in table  # throughput doubles, TTFT quarters
    tput = ("radix-mlx", "output_throughput"), (REFERENCE, "output_throughput")
    ttft = ("radix-mlx", "median_ttft_ms"), (REFERENCE, "median_ttft_ms")
    lines = check_targets(
        results,
        [
            Target("tput", "random", 8, *tput, ">=", 2.5),
            Target("ttft", "random", 8, *ttft, "<=", 0.3),
        ],
    )
    assert "MISS" in lines[0] and "2.000" in lines[0]
    assert "met" in lines[1] and "0.250" in lines[1]


def test_plots_are_written(tmp_path):
    """A concurrency sweep gives the throughput plot; every run feeds the TTFT plot."""
    results = []
    for conc in (1, 4, 8):
        run = _fake_run("radix-mlx", 0.05 * conc, 20, 1.0 / conc)
        run.max_concurrency = conc
        results.append((run, compute_metrics(run)))
    paths = save_plots(results, tmp_path)
    assert [p.name for p in paths] == ["throughput_vs_concurrency.png", "ttft_distribution.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000


def test_code_edit_workload_holds_its_text_and_asks_for_it_back(endpoint, tokenizer):
    spec = WorkloadSpec("code-edit", dict(num_prompts=3, text_len=40, output_len=8))
    factory = PromptFactory(tokenizer, 3)
    n = len(factory.specials)
    for s in build_sessions(spec, factory):
        ids = s.turns[0].ids
        assert len(ids) == 40 + 12 + 2 + 10  # text, instruction, the edit, the text again
        assert ids[-10:] == ids[n + 2 : n + 12]
    run, m = _run(endpoint, tokenizer, spec, max_concurrency=3)
    _check_consistent(run, m)
