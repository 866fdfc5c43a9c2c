"""The worker's side of --max-memory on the real tiny model: the figures it reports, the
step guard refusing a step as out of memory (answered as the worker's loop answers it)
and the runner going on afterwards, token-exact with mlx-lm."""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from common.messages import (
    DecodeBatch,
    ExtendBatch,
    ExtendReq,
    MemoryReport,
    ReleaseReq,
    SamplingParams,
    StepResult,
    WorkerError,
)
from tests.conftest import load_model, mlx_greedy
from worker_mlx.kv_pool import MlxKVPool
from worker_mlx.memory import StepGuard, step_figures
from worker_mlx.model_probe import probe_layout
from worker_mlx.model_runner import ModelRunner
from worker_mlx.worker import execute

GREEDY = SamplingParams(temperature=0, max_new_tokens=6)


def _runner(path: str) -> tuple[ModelRunner, dict]:
    model, _ = load_model(path)
    layout, states = probe_layout(model)
    vocab = int(model(mx.array([[0]])).shape[-1])
    runner = ModelRunner(model, MlxKVPool(layout, 2048), vocab, prefill_step=256)
    return runner, step_figures(model, layout, states, vocab, 256)


def _guard(figures: dict, room: int) -> StepGuard:
    """A guard whose budget leaves `room` bytes beside what mlx holds now."""
    report = MemoryReport(budget=mx.get_active_memory() + room, fixed=0, **figures)
    return StepGuard(report)


def test_figures_follow_the_model_shapes(tiny_model):
    model, _ = load_model(tiny_model)
    runner, figures = _runner(tiny_model)
    args = model.args
    assert figures["score_bytes"] == 4 * args.num_attention_heads + 1  # no windows
    layout = runner.pool.layout
    assert figures["kv_token_bytes"] == layout.bytes_per_slot  # float32 pool: as stored
    assert figures["act_token_bytes"] > 4 * args.hidden_size
    assert figures["prefill_step"] == 256


def test_a_step_the_guard_refuses_is_a_503_and_the_runner_goes_on(tiny_model):
    runner, figures = _runner(tiny_model)
    prompt = [(11 * i + 5) % 400 + 3 for i in range(600)]
    req = ExtendReq("r", prompt, [], list(range(1, 601)), GREEDY)
    guard = _guard(figures, 1 << 20)  # 1 MiB: a 600-token prefill needs more
    reply = execute(runner, ExtendBatch(1, [req]), guard=guard)
    assert isinstance(reply, WorkerError) and reply.out_of_memory
    assert reply.step == 1 and reply.message.startswith("out of memory computing this step")
    assert "--max-memory" in reply.message
    assert "r" not in runner.decodings and runner.buffer is None
    # room again: the same request runs, exactly as mlx-lm generates it
    guard = _guard(figures, 1 << 30)
    out = execute(runner, ExtendBatch(2, [dataclasses.replace(req)]), guard=guard)
    assert isinstance(out, StepResult)
    tokens = list(out.next_token_ids)
    for step in range(3, 8):
        out = execute(runner, DecodeBatch(step, ["r"], [600 + step]), guard=guard)
        tokens += out.next_token_ids
    assert tokens == mlx_greedy(tiny_model, prompt, 6)


def test_a_decode_step_refused_leaves_the_others_requests_servable(tiny_model):
    """A decode step refused for memory: its rows' buffer is dropped (flushed first), the
    scheduler releases them, and a new request is served exactly."""
    runner, figures = _runner(tiny_model)
    guard = _guard(figures, 1 << 30)
    prompt = [(7 * i + 3) % 400 + 3 for i in range(300)]
    first = ExtendReq("a", prompt, [], list(range(1, 301)), GREEDY)
    execute(runner, ExtendBatch(1, [first]), guard=guard)
    execute(runner, DecodeBatch(2, ["a"], [301]), guard=guard)
    guard = _guard(figures, 0)  # nothing left: the decode step is refused
    reply = execute(runner, DecodeBatch(3, ["a"], [302]), guard=guard)
    assert isinstance(reply, WorkerError) and reply.out_of_memory
    assert runner.buffer is None
    runner.release([ReleaseReq("a", flush=False)])  # what the scheduler sends next
    guard = _guard(figures, 1 << 30)
    other = [(5 * i + 1) % 400 + 3 for i in range(40)]
    second = ExtendReq("b", other, [], list(range(400, 440)), GREEDY)
    out = execute(runner, ExtendBatch(4, [second]), guard=guard)
    tokens = list(out.next_token_ids)
    for step in range(5, 10):
        step_out = execute(runner, DecodeBatch(step, ["b"], [440 + step]), guard=guard)
        tokens += step_out.next_token_ids
    assert tokens == mlx_greedy(tiny_model, other, 6)
