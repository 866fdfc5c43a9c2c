"""The scheduler's choice between prefill and decode, driven in-process step by step.

The test plays the worker: each descriptor is answered with a StepResult giving every
request token 7 (any valid id does: what is checked is the order of steps).
"""

from __future__ import annotations

from common.messages import (
    DecodeBatch,
    ExtendBatch,
    GenerateReq,
    ReleaseBatch,
    SamplingParams,
    StepResult,
    WorkerReady,
)
from common.server_args import ServerArgs
from scheduler.scheduler import Scheduler


def make_scheduler(**kw) -> Scheduler:
    args = ServerArgs(model_path="in-process", debug_invariants=True, **kw)
    ready = WorkerReady(4096, "test", 2, 2, 8, "float32", 4096, 1000, [0], "none")
    return Scheduler(args, ready)


def submit(s: Scheduler, rid: str, n_tokens: int, max_new: int = 8) -> None:
    prompt = [2 + (hash(rid) + i) % 900 for i in range(n_tokens)]
    sampling = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    s.on_request(GenerateReq(rid, prompt, sampling))


def run_step(s: Scheduler) -> ExtendBatch | DecodeBatch | ReleaseBatch:
    """Take the next descriptor and answer it as the worker would."""
    batch = s.next_batch()
    if isinstance(batch, ReleaseBatch):
        return batch  # the worker does not answer a release
    if isinstance(batch, ExtendBatch):
        rids = [r.rid for r in batch.reqs if r.last_chunk]
    else:
        rids = list(batch.rids)
    s.on_result(StepResult(batch.step, rids, [7] * len(rids)))
    return batch


def kinds(batches) -> list[str]:
    return ["extend" if isinstance(b, ExtendBatch) else "decode" for b in batches]


def test_running_requests_decode_once_between_prefills():
    """A request that arrives while others run is prefilled after their next decode step,
    so a stream of prompts cannot stall running requests for several prefills in a row."""
    s = make_scheduler()
    submit(s, "a", 40)
    assert kinds([run_step(s)]) == ["extend"]
    submit(s, "b", 40)
    submit(s, "c", 40)
    steps = [run_step(s) for _ in range(3)]
    assert kinds(steps) == ["decode", "extend", "decode"]
    assert steps[0].rids == ["a"]
    assert [r.rid for r in steps[1].reqs] == ["b", "c"]
    assert steps[2].rids == ["a", "b", "c"]


def test_chunks_of_a_long_prompt_alternate_with_decode_steps():
    s = make_scheduler(chunked_prefill_size=64)
    submit(s, "short", 16)
    run_step(s)
    submit(s, "long", 200)  # four chunks of at most 64 tokens
    steps = [run_step(s) for _ in range(8)]
    assert kinds(steps) == ["decode", "extend"] * 4
    assert run_step(s).rids == ["short", "long"]


def test_with_nothing_running_chunks_run_back_to_back():
    s = make_scheduler(chunked_prefill_size=64)
    submit(s, "long", 200)
    assert kinds([run_step(s) for _ in range(5)]) == ["extend"] * 4 + ["decode"]


def test_every_request_finishes():
    s = make_scheduler(chunked_prefill_size=32)
    for i in range(6):
        submit(s, f"r{i}", 20 + 30 * i, max_new=5)
    for _ in range(200):
        if not s.busy:
            break
        run_step(s)
    finished = {o.rid for o in s.take_outputs() if o.finish_reason is not None}
    assert finished == {f"r{i}" for i in range(6)}


def test_evicted_paths_go_to_the_router_but_those_a_queued_prompt_caches_again():
    s = make_scheduler()
    kept, dropped = [5, 6, 7, 8], [9, 10, 11]
    for seq in (kept, dropped):
        s.kv.tree.insert(seq, s.kv.allocator.alloc(len(seq)))
    s.on_request(GenerateReq("q", kept + [12], SamplingParams(max_new_tokens=2)))
    assert s.kv.tree.evict(100) == 7
    assert s.take_evicted() == [[9]]  # [5] is left out: "q" puts it back
    assert s.take_evicted() == []  # each path is reported once
