"""Hybrid models (recurrent layers beside attention) in the worker, against mlx-lm.

Qwen3.5 and Qwen3-Next (gated-delta layers) and Nemotron-H (Mamba-2 layers): each
request's recurrent state lives in the worker's state pool at the slot the descriptor
names, and a prefix is reused only together with a snapshot of the state at its end.
Driven through the slot contract as the scheduler drives it: snapshots asked for at a
prompt's last-but-one token, at chunk boundaries and at release; a repeated prompt and
the next turn of a conversation start from them.
"""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest

from common.messages import ReleaseReq
from tests.test_model_runner import Harness, generate, random_prompt, reference

FAMILIES = ["qwen3_5", "qwen3_next", "nemotron_h", "granite4", "falcon_h1"]
STEPS = 16


class HybridHarness(Harness):
    """The runner with a state pool; state slots handed out like KV slots."""

    def __init__(
        self, path: str, compile_decode: bool = True, num_states: int = 64, **modes
    ):  # fmt: skip
        self.num_states = num_states
        super().__init__(path, compile_decode=compile_decode, **modes)
        self.free_states = list(range(num_states, 0, -1))
        self.state_of: dict[str, int] = {}

    def runner_modes(self, model) -> dict:
        from worker_mlx.model_probe import probe_layout
        from worker_mlx.state_pool import StatePool

        _, layout = probe_layout(model)
        # as the loader decides: right-padded prefill rows only where the self-check holds
        states = StatePool(layout, self.num_states)
        return {"states": states, "pad_prefill": padding_works(self.path)}

    def new_state(self) -> int:
        return self.free_states.pop()

    def ereq(self, rid, new_ids, prefix=([], []), sampling=None, last_chunk=True,
             out_cache_loc=None, prefix_state=0, snapshots=()):  # fmt: skip
        req = super().ereq(rid, new_ids, prefix, sampling, last_chunk, out_cache_loc)
        state = self.state_of.setdefault(rid, self.new_state())
        return dataclasses.replace(
            req, state_slot=state, prefix_state=prefix_state, snapshots=[list(s) for s in snapshots]
        )


@functools.cache
def padding_works(path: str) -> bool:
    from tests.conftest import load_model
    from worker_mlx.model_probe import probe_layout
    from worker_mlx.self_check import batched_path_works

    model, _ = load_model(path)
    kv, states = probe_layout(model)
    return batched_path_works(model, kv, 400, True, state_layout=states)


def test_the_self_check_finds_which_recurrent_layers_take_padding(tiny_arch):
    """mlx-lm's Nemotron-H Mamba-2 layers read a right-padded row's state at the padding;
    Granite 4's and Falcon-H1's (masked) and its gated-delta layers honour the row lengths."""
    assert not padding_works(tiny_arch("nemotron_h"))
    assert padding_works(tiny_arch("granite4")) and padding_works(tiny_arch("falcon_h1"))
    assert padding_works(tiny_arch("qwen3_5")) and padding_works(tiny_arch("qwen3_next"))


@pytest.fixture(scope="module", params=FAMILIES)
def hybrid(request, tiny_arch) -> str:
    return tiny_arch(request.param)


@pytest.mark.parametrize("compile_decode", [True, False], ids=["compiled", "eager"])
def test_eight_mixed_lengths_batched(hybrid, compile_decode):
    """Right-padded rows: padding must enter neither the state nor the conv window."""
    h = HybridHarness(hybrid, compile_decode=compile_decode)
    rng = random.Random(41)
    lengths = [70, 1, 90, 5, 64, 17, 100, 33]
    prompts = {f"r{i}": random_prompt(rng, n, h.vocab) for i, n in enumerate(lengths)}
    max_new = {rid: STEPS - i for i, rid in enumerate(prompts)}
    got = generate(h, prompts, max_new, free_finished=True)
    for rid, prompt in prompts.items():
        assert got[rid] == reference(h.path, prompt, len(got[rid])), rid


def test_repeat_and_next_turn_start_from_snapshots(hybrid):
    """A: snapshot after its last-but-one prompt token and at release. The same prompt
    again (one token computed, as a decode step) and a next turn (prompt + answer + new
    tokens) start from those snapshots and match mlx-lm."""
    h = HybridHarness(hybrid)
    rng = random.Random(42)
    prompt = random_prompt(rng, 80, h.vocab)
    at_last_but_one, at_end = h.new_state(), h.new_state()
    h.extend([h.ereq("A", prompt, snapshots=[(len(prompt) - 1, at_last_but_one)])])
    for _ in range(STEPS - 1):
        h.decode()
    h.release([ReleaseReq("A", flush=True, snapshot=at_end)])
    answer = h.out["A"]
    assert answer == reference(h.path, prompt, STEPS)

    again = h.ereq(
        "again", prompt[-1:], h.prefix("A", len(prompt) - 1), prefix_state=at_last_but_one
    )
    h.extend([again])
    for _ in range(STEPS - 1):
        h.decode()
    h.release([ReleaseReq("again", flush=True)])
    assert h.out["again"] == answer

    history = prompt + answer + random_prompt(rng, 11, h.vocab)
    known = len(prompt) + STEPS - 1  # the answer's last token has no KV or state yet
    h.extend([h.ereq("turn", history[known:], h.prefix("A", known), prefix_state=at_end)])
    for _ in range(STEPS - 1):
        h.decode()
    assert h.out["turn"] == reference(h.path, history, STEPS)


@pytest.mark.parametrize("prefill_step", [16, 256])
def test_chunked_prefill_with_snapshots_at_the_boundaries(hybrid, prefill_step):
    """Scheduler chunks of 30 continue from the request's own working state; each chunk
    snapshots its end (mid-piece when the worker cuts at 16), and a second request
    starting from the second boundary's snapshot matches mlx-lm."""
    h = HybridHarness(hybrid, prefill_step=prefill_step)
    rng = random.Random(43)
    prompt = random_prompt(rng, 100, h.vocab)
    other = random_prompt(rng, 40, h.vocab)
    h.extend([h.ereq("other", other)])
    boundary = {}
    for i in range(0, 100, 30):
        chunk, last = prompt[i : i + 30], i + 30 >= 100
        snap = h.new_state()
        boundary[i + len(chunk)] = snap
        prefix = h.prefix("long") if i else ([], [])
        state = h.state_of.get("long", 0)
        snapshots = [(len(chunk) - 7, snap)] if last else [(len(chunk), snap)]
        req = h.ereq("long", chunk, prefix, last_chunk=last, prefix_state=state)
        h.extend([dataclasses.replace(req, snapshots=[list(x) for x in snapshots])])
        h.decode(["other"])
    for _ in range(STEPS - 1):
        h.decode()
    assert h.out["long"] == reference(h.path, prompt, STEPS)
    assert h.out["other"] == reference(h.path, other, len(h.out["other"]))
    tail = random_prompt(rng, 9, h.vocab)
    h.extend([h.ereq("B", prompt[60:] + tail, h.prefix("long", 60), prefix_state=boundary[60])])
    for _ in range(STEPS - 1):
        h.decode(["B"])
    assert h.out["B"] == reference(h.path, prompt + tail, STEPS)


def test_cpu_kernels_and_the_state_checks(hybrid):
    """With the CPU backend's kernels the batch still matches; a prefix without its state,
    or a state slot outside the pool, is refused with the runner left usable."""
    from worker_mlx.backends import cpu_kernels

    h = HybridHarness(hybrid)
    rng = random.Random(44)
    prompts = {f"r{i}": random_prompt(rng, n, h.vocab) for i, n in enumerate((300, 7, 90))}
    want = {rid: reference(h.path, p, STEPS) for rid, p in prompts.items()}
    uninstall = cpu_kernels.install(h.model)
    try:
        assert generate(h, prompts, STEPS) == want
    finally:
        if uninstall is not None:
            uninstall()
    bad = h.ereq("x", [5, 6], h.prefix("r0", 10))
    with pytest.raises(ValueError, match="recurrent state"):
        h.extend([bad])
    with pytest.raises(ValueError, match="state slot outside"):
        h.extend([dataclasses.replace(h.ereq("y", [5, 6]), state_slot=10_000)])
    assert generate(h, {"z": prompts["r1"]}, STEPS)["z"] == want["r1"]


def test_a_step_computed_ahead_and_taken_back_leaves_the_states_as_before(tiny_arch):
    """The worker computes the next decode step while the scheduler works (run_ahead); a
    descriptor that is not that step takes it back, and the recurrent states must be the
    ones from before it (a state one token ahead made granite4 drift under retractions)."""
    h = HybridHarness(tiny_arch("granite4"))
    rng = random.Random(44)
    prompts = {"A": random_prompt(rng, 30, h.vocab), "B": random_prompt(rng, 20, h.vocab)}
    h.extend([h.ereq(rid, p) for rid, p in prompts.items()])
    for step in range(STEPS - 1):
        h.worker.run_ahead()  # a bet on the same rows' next step ...
        if step == 3:  # ... lost: B leaves, so the step is taken back
            h.decode(["A"], release=[ReleaseReq("B", flush=True)], lookahead=True)
        else:
            h.decode(lookahead=True)  # the scheduler says this step's rows go on
    assert h.out["A"] == reference(h.path, prompts["A"], STEPS)
