"""ModelRunner against mlx-lm's own greedy generation, driven through the slot contract.

A small in-test slot allocator plays the scheduler: it hands out pool slots (1..N, slot 0
is padding) for extend and decode descriptors and frees them on release, most recently
freed first so that slot reuse happens as soon as it can. Every generated sequence is
compared with `mlx_greedy` (mlx-lm with its own KV cache), and where the pool itself is
the point, the pool rows are compared with the KV mlx-lm computes for the same tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest

from common.messages import DecodeBatch, ExtendBatch, ExtendReq, ReleaseReq, SamplingParams
from tests.conftest import load_model, mlx_greedy

N_SLOTS = 1024
DECODE_STEPS = 12


def greedy(n: int = DECODE_STEPS) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n)


def seeded(seed: int | None, n: int = 10) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_new_tokens=n)


@functools.cache
def _reference(path: str, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    return tuple(mlx_greedy(path, list(prompt), n))


def reference(path: str, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's greedy continuation of `prompt` (cached: several tests share prompts)."""
    return list(_reference(path, tuple(prompt), n))


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


def vocab_size(path: str) -> int:
    import mlx.core as mx

    model, _ = load_model(path)
    return int(model(mx.array([[0]])).shape[-1])


@pytest.fixture(params=["tiny_model", "tiny_llama"])
def model_path(request) -> str:
    return request.getfixturevalue(request.param)


class SlotAllocator:
    """A free list over slots 1..N; freed slots are handed out again first (LIFO)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free_list = list(range(1, num_slots + 1))

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free_list):
            raise RuntimeError(f"out of slots: want {n}, have {len(self.free_list)}")
        out, self.free_list = self.free_list[:n], self.free_list[n:]
        return out

    def free(self, slots: list[int]) -> None:
        assert not set(slots) & set(self.free_list), "double free"
        assert all(1 <= s <= self.num_slots for s in slots)
        self.free_list = list(slots) + self.free_list


class Harness:
    """A ModelRunner plus the scheduler-side bookkeeping of the slot contract.

    For each request: `slots[rid]` are the slots holding (or, while deferred, about to
    hold) its KV and `tokens[rid]` the tokens whose KV that is (prompt + generated[:-1]);
    `out[rid]` are its sampled tokens.
    """

    def __init__(
        self, path: str, num_slots: int = N_SLOTS, seed: int = 0, compile_decode: bool = True,
        kv_cache_dtype: str = "auto", **modes,
    ):  # fmt: skip
        """`modes`: the runner's other constructor arguments (pipeline_stage, grammars,
        prefill_step, lora, ...), chosen once as the loader chooses them; `model`: one
        loaded for this harness (default: the path's shared one). `proposer`: the
        Verifier's (speculation.py), which wraps a runner that verifies drafts as the
        loader's does (default: the scheduler's drafts, in the descriptor); `worker` is
        then the Verifier, else the runner."""
        from worker_mlx.kv_pool import MlxKVPool
        from worker_mlx.model_probe import probe_kv_layout
        from worker_mlx.model_runner import ModelRunner
        from worker_mlx.proposer import SchedulerDrafts
        from worker_mlx.speculation import Verifier

        proposer = modes.pop("proposer", None) or SchedulerDrafts()

        model = modes.pop("model", None) or load_model(path)[0]
        self.path = path
        self.model = model
        self.vocab = vocab_size(path)
        layout = dataclasses.replace(probe_kv_layout(model), kv_cache_dtype=kv_cache_dtype)
        self.pool = MlxKVPool(layout, num_slots)
        self.runner = ModelRunner(
            model, self.pool, self.vocab, seed=seed, compile_decode=compile_decode,
            **self.runner_modes(model), **modes,
        )  # fmt: skip
        self.worker = self.runner
        if self.runner.verifies_drafts:
            self.worker = Verifier(self.runner, proposer)
        self.alloc = SlotAllocator(num_slots)
        self.slots: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.out: dict[str, list[int]] = {}
        # per request and sampled token, its top logprobs, where the sampling asked for them
        self.top: dict[str, list[list]] = {}
        self.running: list[str] = []
        self.step = 0

    def runner_modes(self, model) -> dict:
        """Constructor arguments a subclass derives from the loaded model."""
        return {}

    def prefix(self, rid: str, n: int | None = None) -> tuple[list[int], list[int]]:
        """(slots, tokens) of the first `n` (default all) KV positions of `rid`."""
        n = len(self.slots[rid]) if n is None else n
        return self.slots[rid][:n], self.tokens[rid][:n]

    def ereq(
        self,
        rid: str,
        new_ids: list[int],
        prefix: tuple[list[int], list[int]] = ([], []),
        sampling: SamplingParams | None = None,
        last_chunk: bool = True,
        out_cache_loc: list[int] | None = None,
    ) -> ExtendReq:
        prefix_slots, prefix_tokens = prefix
        loc = self.alloc.alloc(len(new_ids)) if out_cache_loc is None else out_cache_loc
        self.slots[rid] = list(prefix_slots) + loc
        self.tokens[rid] = list(prefix_tokens) + list(new_ids)
        self.out.setdefault(rid, [])
        return ExtendReq(
            rid, list(new_ids), list(prefix_slots), loc, sampling or greedy(), last_chunk
        )

    def extend(self, reqs: list[ExtendReq], release: list[ReleaseReq] = ()) -> None:
        self.step += 1
        res = self.worker.extend(ExtendBatch(self.step, reqs, list(release)))
        assert res.rids == [r.rid for r in reqs if r.last_chunk]
        assert len(res.next_token_ids) == len(res.rids)
        self._gone(release)
        self._record_top(res)
        for rid, tok in zip(res.rids, res.next_token_ids):
            assert 0 <= tok < self.vocab
            self.out[rid].append(tok)
            self.running.append(rid)

    def _record_top(self, res) -> None:
        for rid, top in zip(res.rids, res.top_logprobs or []):
            self.top.setdefault(rid, []).append(top)

    def decode(
        self, rids: list[str] | None = None, release: list[ReleaseReq] = (), lookahead=False
    ) -> None:
        gone = {r.rid for r in release}
        rids = [r for r in self.running if r not in gone] if rids is None else rids
        locs = self.alloc.alloc(len(rids))
        self.step += 1
        batch = DecodeBatch(self.step, list(rids), locs, list(release), lookahead=lookahead)
        res = self.worker.decode(batch)
        assert res.rids == rids
        self._gone(release)
        self._record_top(res)
        for rid, loc, tok in zip(rids, locs, res.next_token_ids):
            assert 0 <= tok < self.vocab
            self.slots[rid].append(loc)
            self.tokens[rid].append(self.out[rid][-1])
            self.out[rid].append(tok)

    def release(self, release: list[ReleaseReq]) -> None:
        self.worker.release(release)
        self._gone(release)

    def _gone(self, release: list[ReleaseReq]) -> None:
        gone = {r.rid for r in release}
        self.running = [r for r in self.running if r not in gone]

    def free(self, rid: str) -> list[int]:
        """Return all of `rid`'s slots to the allocator, last written first in line for reuse."""
        freed = self.slots[rid]
        self.alloc.free(freed[::-1])
        self.slots[rid], self.tokens[rid] = [], []
        return freed

    def assert_pool_holds(self, rid: str) -> None:
        """The pool rows at `rid`'s slots equal the KV mlx-lm computes for its tokens."""
        import mlx.core as mx
        import numpy as np
        from mlx_lm.models.cache import make_prompt_cache

        slots, tokens = self.prefix(rid)
        assert len(slots) == len(tokens) > 0
        cache = make_prompt_cache(self.model)
        self.model(mx.array([tokens]), cache=cache)
        idx = mx.array(slots, dtype=mx.int32)
        for layer, c in enumerate(cache):
            ref_k, ref_v = c.keys_and_values()
            got_k, got_v = self.pool.gather(layer, idx)
            for got, ref in ((got_k, ref_k), (got_v, ref_v)):
                ref = np.array(ref[0].transpose(1, 0, 2))  # (T, H, D)
                np.testing.assert_allclose(
                    np.array(got), ref, rtol=1e-4, atol=1e-4, err_msg=f"{rid} layer {layer}"
                )


def generate(
    h: Harness,
    prompts: dict[str, list[int]],
    max_new: dict[str, int] | int = DECODE_STEPS,
    sampling: dict[str, SamplingParams] | None = None,
    free_finished: bool = False,
) -> dict[str, list[int]]:
    """Extend every prompt in one ExtendBatch, then decode the running requests together.

    A request that has its `max_new` tokens is released (flush=True) with the next
    descriptor; with `free_finished` its slots go straight back to the allocator, so the
    next decode step reuses them.
    """
    limits = max_new if isinstance(max_new, dict) else {rid: max_new for rid in prompts}
    sampling = sampling or {}
    reqs = [
        h.ereq(rid, ids, sampling=sampling.get(rid, greedy(limits[rid])))
        for rid, ids in prompts.items()
    ]
    h.extend(reqs)
    while True:
        done = [rid for rid in h.running if rid in limits and len(h.out[rid]) >= limits[rid]]
        release = [ReleaseReq(rid, flush=True) for rid in done]
        if len(done) == len(h.running):
            h.release(release)
            break
        if free_finished:
            # the runner flushes on release, before the descriptor's own work, so the
            # freed slots are reused by this very decode step
            for rid in done:
                h.free(rid)
        h.decode(release=release)
    for rid in prompts:
        assert len(h.out[rid]) == limits[rid]
    return {rid: h.out[rid] for rid in prompts}


def assert_parity(h: Harness, prompts: dict[str, list[int]], got: dict[str, list[int]]):
    for rid, prompt in prompts.items():
        want = reference(h.path, prompt, len(got[rid]))
        assert got[rid] == want, f"{rid} (prompt length {len(prompt)})"


# ---------------------------------------------------------------- 1. batched parity


@pytest.mark.parametrize("compile_decode", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("batch_size", range(1, 9))
def test_batched_extend_and_decode_match_mlx_lm(model_path, batch_size, compile_decode):
    h = Harness(model_path, compile_decode=compile_decode)
    rng = random.Random(100 + batch_size)
    lengths = [1, 40] + [rng.randint(1, 40) for _ in range(batch_size)]
    prompts = {f"r{i}": random_prompt(rng, lengths[i], h.vocab) for i in range(batch_size)}
    got = generate(h, prompts, DECODE_STEPS)
    assert_parity(h, prompts, got)


@pytest.mark.parametrize("compile_decode", [True, False], ids=["compiled", "eager"])
def test_decode_buffer_growth_matches_mlx_lm(model_path, compile_decode):
    """Prompts straddling the decode buffer's 256-column capacity, so it grows mid-run."""
    h = Harness(model_path, compile_decode=compile_decode)
    rng = random.Random(7)
    prompts = {"long": random_prompt(rng, 250, h.vocab), "short": random_prompt(rng, 3, h.vocab)}
    got = generate(h, prompts, DECODE_STEPS)
    assert_parity(h, prompts, got)
    h.assert_pool_holds("long")


def test_long_generation_through_the_compiled_step(tiny_model):
    """520 decode steps from short prompts: the compiled step's buffer doubles twice and
    its attention width is retraced every 64 columns, and with at most 3 traces kept the
    step is compiled afresh several times; tokens still match mlx-lm."""
    from worker_mlx.decode_step import attention_width

    h = Harness(tiny_model, num_slots=2048)
    step = h.runner.decode_step
    step.max_traces = 3
    rng = random.Random(12)
    prompts = {"a": random_prompt(rng, 5, h.vocab), "b": random_prompt(rng, 30, h.vocab)}
    got = generate(h, prompts, 520)
    assert_parity(h, prompts, got)
    assert len(step.shapes) <= 3 and step.compiled >= 3  # 9 shapes: 3 compilations
    # widths: multiples of 64 up to 512 columns, then an eighth of the capacity
    assert [attention_width(c, 256)[0] for c in (0, 63, 64, 255)] == [64, 64, 128, 256]
    assert [attention_width(c, 1024)[0] for c in (0, 127, 128, 1000)] == [128, 128, 256, 1024]
    # every column a width serves is at or past its `lowest`, which windows start from
    for cap in (256, 1000, 1024):
        for c in range(cap):
            width, lowest = attention_width(c, cap)
            assert lowest <= c < width


def test_a_window_reads_exactly_its_columns_at_every_width():
    """Where a compiled width reaches further back than the window, a windowed layer
    reads the `window` columns that end at the written one: its mask there equals the
    full-width mask, and no column outside the block is visible to any row."""
    import mlx.core as mx

    from worker_mlx.decode_step import attention_width
    from worker_mlx.layer_caches import StepColumns

    window, cap = 16, 1024
    left_pad = mx.array([0, 3, 40])
    moved = 0
    for c in range(0, cap, 7):
        width, lowest = attention_width(c, cap)
        columns = StepColumns(mx.array([c]), left_pad, width, lowest)
        static = columns.full & (columns.cols > c - window)  # every column, window-masked
        if not columns.moves(window):
            assert columns.mask(window).shape[-1] == width - columns.start(window)
            continue
        moved += 1
        start = columns.window_start(window).item()
        block = columns.mask(window)
        assert block.shape[-1] == window and 0 <= start <= width - window
        assert mx.array_equal(block, static[..., start : start + window]).item()
        assert not static[..., :start].any().item() and not static[..., start + window :].any()
    assert moved > 100


# ---------------------------------------------------------------- 2. staggered finishes


@pytest.mark.parametrize("free_finished", [False, True])
def test_requests_finishing_at_different_times(model_path, free_finished):
    h = Harness(model_path)
    rng = random.Random(2)
    max_new = {"a": 1, "b": 3, "c": 5, "d": 8, "e": 12, "f": 12}
    prompts = {rid: random_prompt(rng, rng.randint(1, 30), h.vocab) for rid in max_new}
    got = generate(h, prompts, max_new, free_finished=free_finished)
    assert_parity(h, prompts, got)
    for rid in ("e", "f"):  # still own their slots: all flushed, none overwritten
        h.assert_pool_holds(rid)


@pytest.mark.parametrize("compile_decode", [True, False], ids=["compiled", "eager"])
def test_joining_requests_take_dead_rows(model_path, compile_decode):
    """A request that joins the running batch takes over the decode-buffer row of one that
    left instead of a rebuild; a context longer than the buffer's, or more dead rows than
    live ones, rebuild it. Outputs stay equal to mlx-lm's throughout."""
    h = Harness(model_path, compile_decode=compile_decode)
    rng = random.Random(21)
    lengths = {"a": 30, "b": 25, "c": 20, "d": 12, "e": 60}
    prompts = {rid: random_prompt(rng, n, h.vocab) for rid, n in lengths.items()}
    h.extend([h.ereq(rid, prompts[rid]) for rid in "abc"])
    for _ in range(3):
        h.decode()
    rows = {rid: h.runner.kv_location(rid).row for rid in "abc"}
    assert sorted(rows.values()) == [0, 1, 2]
    h.decode(release=[ReleaseReq("b", flush=True)])
    h.extend([h.ereq("d", prompts["d"])])
    for _ in range(4):
        h.decode()
    assert {rid: h.runner.kv_location(rid).row for rid in "adc"} == {
        "a": rows["a"],
        "d": rows["b"],
        "c": rows["c"],
    }
    h.extend([h.ereq("e", prompts["e"])])  # 60 tokens: more than the buffer's 38 columns
    h.decode()
    assert sorted(h.runner.kv_location(rid).row for rid in "acde") == [0, 1, 2, 3]  # rebuilt
    h.decode(release=[ReleaseReq(rid, flush=True) for rid in "acd"])  # 3 dead rows of 4
    assert h.runner.kv_location("e").row == 0  # rebuilt for e alone
    for _ in range(3):
        h.decode()
    h.release([ReleaseReq("e", flush=True)])
    for rid, prompt in prompts.items():
        assert h.out[rid] == reference(h.path, prompt, len(h.out[rid])), rid


def test_steady_traffic_keeps_the_decode_buffer_narrow(tiny_model, monkeypatch):
    """One request in, one out, for many steps: the buffer lives on (joiners take dead
    rows), and the left padding every row shares is shifted out instead of growing with
    each step (without that, the buffer would pass 150 columns here). Outputs equal mlx-lm's."""
    from worker_mlx.decode_buffer import DecodeBuffer

    monkeypatch.setattr(DecodeBuffer, "COMPACT_COLUMNS", 16)
    h = Harness(tiny_model)
    rng = random.Random(8)
    prompts, limits = {}, {}

    def start(rid: str, n_new: int) -> None:
        prompts[rid] = random_prompt(rng, rng.randint(5, 20), h.vocab)
        limits[rid] = n_new
        h.extend([h.ereq(rid, prompts[rid], sampling=greedy(n_new))])

    for i, n in enumerate((6, 9, 12)):
        start(f"r{i}", n)
    h.decode()
    widths, started = [], 3
    for _ in range(150):
        done = [rid for rid in h.running if len(h.out[rid]) >= limits[rid]]
        if done:
            h.release([ReleaseReq(rid, flush=True) for rid in done])
            for rid in done:
                h.free(rid)
                start(f"r{started}", rng.randint(6, 12))
                started += 1
        h.decode()
        widths.append(max(h.runner.kv_location(rid).columns.stop for rid in h.running))
    assert max(widths) <= 20 + 12 + 16  # longest context + the threshold
    for rid, prompt in prompts.items():
        assert h.out[rid] == reference(h.path, prompt, len(h.out[rid])), rid


def test_kv_location_follows_the_deferred_flush(model_path):
    """Decode KV is in the decode buffer only until an extend (or a release) flushes it;
    the pool holds everything else, and the pool really holds it then."""
    h = Harness(model_path)
    rng = random.Random(14)
    h.extend([h.ereq("X", random_prompt(rng, 9, h.vocab))])
    where = h.runner.kv_location("X")
    assert where.pool_slots == h.slots["X"] and where.buffered_slots == [] and where.row is None
    for _ in range(5):
        h.decode()
    where = h.runner.kv_location("X")
    assert where.pool_slots == h.slots["X"][:9] and where.buffered_slots == h.slots["X"][9:]
    assert where.row == 0 and len(where.columns) == 14
    h.extend([h.ereq("Y", random_prompt(rng, 4, h.vocab))])
    assert h.runner.kv_location("X").pool_slots == h.slots["X"]
    assert h.runner.kv_location("X").buffered_slots == []
    h.assert_pool_holds("X")


# ---------------------------------------------------------------- 3. cached prefixes


@pytest.mark.parametrize("cut", ["prompt", "mid_generated", "all"])
def test_extend_on_cached_prefix(model_path, cut):
    """A released request's KV reused as prefix, cut inside its prompt or its output."""
    h = Harness(model_path)
    rng = random.Random(3)
    a = random_prompt(rng, 20, h.vocab)
    got_a = generate(h, {"A": a}, 8)["A"]
    assert got_a == reference(h.path, a, 8)
    # KV exists for A + got_a[:-1]; the last sampled token has none yet
    n = {"prompt": 13, "mid_generated": len(a) + 4, "all": len(a) + 7}[cut]
    prefix = h.prefix("A", n)
    history = a + got_a
    user = random_prompt(rng, 9, h.vocab)
    full = history[: len(a) + 8] + user
    # batched with a request without prefix, so the prefix lengths differ within the batch
    other = random_prompt(rng, 17, h.vocab)
    h.extend([h.ereq("B", full[n:], prefix=prefix), h.ereq("C", other)])
    for _ in range(DECODE_STEPS - 1):
        h.decode()
    assert h.out["B"] == reference(h.path, full, DECODE_STEPS)
    assert h.out["C"] == reference(h.path, other, DECODE_STEPS)


@pytest.mark.parametrize("compile_decode", [True, False], ids=["compiled", "eager"])
def test_repeated_prompts_extend_one_token(model_path, compile_decode):
    """Prompts cached but for their last token (sent again): a batch of such extends, one
    with an empty prefix, then decode; with the compiled step this runs as a decode step."""
    h = Harness(model_path, compile_decode=compile_decode)
    rng = random.Random(8)
    prompts = {"A": random_prompt(rng, 30, h.vocab), "B": random_prompt(rng, 12, h.vocab)}
    first = generate(h, prompts, 4)
    for rid in prompts:
        assert first[rid] == reference(h.path, prompts[rid], 4)
    solo = random_prompt(rng, 1, h.vocab)
    h.extend(
        [
            h.ereq("A2", prompts["A"][-1:], prefix=h.prefix("A", len(prompts["A"]) - 1)),
            h.ereq("B2", prompts["B"][-1:], prefix=h.prefix("B", len(prompts["B"]) - 1)),
            h.ereq("S", solo),
        ]
    )
    # another prompt sharing the extended token right away reads its KV from the pool
    more = random_prompt(rng, 5, h.vocab)
    h.extend([h.ereq("C", more, prefix=h.prefix("A2", len(prompts["A"])))])
    for _ in range(DECODE_STEPS - 1):
        h.decode()
    assert h.out["C"] == reference(h.path, prompts["A"] + more, DECODE_STEPS)
    assert h.out["A2"] == reference(h.path, prompts["A"], DECODE_STEPS)
    assert h.out["B2"] == reference(h.path, prompts["B"], DECODE_STEPS)
    assert h.out["S"] == reference(h.path, solo, DECODE_STEPS)
    h.release([ReleaseReq("A2", flush=True)])
    h.assert_pool_holds("A2")


def test_same_prompt_again_reads_the_finished_requests_buffer(model_path):
    """A prompt sent again right after its request finished: the one-token step runs on
    that request's decode buffer (no gather); a cached prompt of another request does not."""
    h = Harness(model_path)
    rng = random.Random(12)
    first, prompt = random_prompt(rng, 30, h.vocab), random_prompt(rng, 40, h.vocab)
    assert generate(h, {"C": first}, 3)["C"] == reference(h.path, first, 3)
    assert generate(h, {"A": prompt}, 5)["A"] == reference(h.path, prompt, 5)
    buffer = h.runner.buffer

    h.extend([h.ereq("A2", prompt[-1:], prefix=h.prefix("A", len(prompt) - 1))])
    assert h.runner.buffer is buffer
    for _ in range(DECODE_STEPS - 1):
        h.decode()
    assert h.out["A2"] == reference(h.path, prompt, DECODE_STEPS)

    h.release([ReleaseReq("A2", flush=True)])
    h.extend([h.ereq("C2", first[-1:], prefix=h.prefix("C", len(first) - 1))])
    assert h.runner.buffer is not buffer  # gathered from the pool
    for _ in range(3):
        h.decode()
    assert h.out["C2"] == reference(h.path, first, 4)


def test_multi_turn_conversation(model_path):
    """Turn k+1 = turn k's prompt + its output + new user tokens, prefix = all of turn k's KV."""
    h = Harness(model_path)
    rng = random.Random(4)
    history = random_prompt(rng, 15, h.vocab)
    got = generate(h, {"t0": history}, 6)["t0"]
    assert got == reference(h.path, history, 6)
    for turn in (1, 2, 3):
        prev = f"t{turn - 1}"
        user = random_prompt(rng, 4 + turn, h.vocab)
        prefix = h.prefix(prev)  # prompt + generated[:-1]
        assert prefix[1] == history + got[:-1]
        history = history + got + user
        # the last sampled token of the previous turn has no KV: it leads the new tokens
        rid = f"t{turn}"
        h.extend([h.ereq(rid, history[len(prefix[0]) :], prefix=prefix)])
        for _ in range(5):
            h.decode()
        h.release([ReleaseReq(rid, flush=True)])
        got = h.out[rid]
        assert got == reference(h.path, history, 6), f"turn {turn}"
    h.assert_pool_holds("t3")


# ---------------------------------------------------------------- 4. chunked prefill


@pytest.mark.parametrize("interleave", [False, True])
def test_chunked_prefill(model_path, interleave):
    """100 tokens in chunks of 32 (last_chunk False, False, False, True); optionally another
    request decodes between the chunks, so each chunk's extend must flush its deferred KV."""
    h = Harness(model_path)
    rng = random.Random(5)
    prompt = random_prompt(rng, 100, h.vocab)
    other = random_prompt(rng, 11, h.vocab)
    if interleave:
        h.extend([h.ereq("other", other)])
    chunks = [prompt[i : i + 32] for i in range(0, 100, 32)]
    assert [len(c) for c in chunks] == [32, 32, 32, 4]
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        prefix = h.prefix("long") if i else ([], [])
        h.extend([h.ereq("long", chunk, prefix=prefix, last_chunk=last)])
        assert ("long" in h.running) == last
        if interleave:
            h.decode(["other"])
            h.decode(["other"])
    assert len(h.slots["long"]) == 100
    for _ in range(DECODE_STEPS - 1):
        h.decode()
    assert h.out["long"] == reference(h.path, prompt, DECODE_STEPS)
    if interleave:
        assert h.out["other"] == reference(h.path, other, len(h.out["other"]))
    h.release([ReleaseReq(rid, flush=True) for rid in list(h.running)])
    h.assert_pool_holds("long")


def test_a_one_token_piece_then_another_pass_writes_the_pool_in_place(tiny_model):
    """A pass that samples no row leaves its output unevaluated; a one-token piece's
    attention never evaluates what it read from the pool either. Were that output alive
    at the next pass, the pool would have two users and the next write would copy all
    of it (on the server: 1 GiB of fresh memory a layer, a 2.5 s extend). Passes here:
    [a0 b0], [b1], [a1: one token, a's chunk not its last], [b2] (with the CPU backend's
    kernels, as the worker runs; without them, or with pieces of 16 tokens, the pool was
    not copied even before)."""
    import mlx.core as mx

    from worker_mlx.backends import select

    model = load_model(tiny_model)[0]
    undo = select().install(model)  # as the worker runs it
    try:
        h = Harness(tiny_model, num_slots=1 << 17, prefill_step=64, model=model)
        rng = random.Random(9)
        a, b = random_prompt(rng, 65, h.vocab), random_prompt(rng, 192, h.vocab)
        h.extend([h.ereq("warm", random_prompt(rng, 192, h.vocab))])  # first-use costs
        mx.eval(h.pool.arrays())
        part = h.pool.parts[0][0].nbytes
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        h.extend([h.ereq("a", a, last_chunk=False), h.ereq("b", b)])
        assert mx.get_peak_memory() - before < part // 2
    finally:
        undo()
    assert h.out["b"] == reference(h.path, b, 1)


def test_solo_decode_writes_the_pool_in_place(tiny_model):
    """The unbatched fallback runs each row's decode as its own one-token pass; a row's
    logits left lazy held the pool when the next row's pass wrote it, so every decode
    step copied the whole pool (here +32 MiB against a 16 MiB part, 14.5 ms a step
    instead of 3.7)."""
    import mlx.core as mx

    h = Harness(tiny_model, num_slots=1 << 17, batched=False)
    rng = random.Random(3)
    x, y = random_prompt(rng, 40, h.vocab), random_prompt(rng, 30, h.vocab)
    h.extend([h.ereq("x", x), h.ereq("y", y)])
    h.decode()
    mx.eval(h.pool.arrays())
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    h.decode()
    assert mx.get_peak_memory() - before < h.pool.parts[0][0].nbytes // 2
    assert h.out["x"] == reference(h.path, x, 3)
    assert h.out["y"] == reference(h.path, y, 3)


# ---------------------------------------------------------------- 5. failure mode 1


def test_prefix_with_generated_tokens_of_released_request(model_path):
    """Failure mode 1: a new request matching a prefix that includes another request's
    generated tokens must not read zeros; release(flush=True) writes the deferred KV."""
    h = Harness(model_path)
    rng = random.Random(6)
    x = random_prompt(rng, 10, h.vocab)
    z = random_prompt(rng, 21, h.vocab)
    # X decodes alongside Z, so the flush must pick X's row out of a shared decode buffer
    h.extend([h.ereq("X", x), h.ereq("Z", z)])
    for _ in range(7):
        h.decode()
    h.release([ReleaseReq("X", flush=True)])
    h.assert_pool_holds("X")
    prefix = h.prefix("X")
    extra = random_prompt(rng, 5, h.vocab)
    full = x + h.out["X"] + extra
    h.extend([h.ereq("Y", full[len(prefix[0]) :], prefix=prefix)])
    for _ in range(DECODE_STEPS - 1):
        h.decode()
    assert h.out["X"] == reference(h.path, x, 8)
    assert h.out["Y"] == reference(h.path, full, DECODE_STEPS)
    assert h.out["Z"] == reference(h.path, z, len(h.out["Z"]))


def test_prefix_with_generated_tokens_of_running_request(model_path):
    """Failure mode 1 while X is still decoding: the extend flushes X's deferred KV first,
    so X's decode slots are a correct prefix, and X keeps decoding correctly afterwards."""
    h = Harness(model_path)
    rng = random.Random(8)
    x = random_prompt(rng, 12, h.vocab)
    h.extend([h.ereq("X", x)])
    for _ in range(6):
        h.decode()
    prefix = h.prefix("X")  # X's prompt + 6 decoded tokens, only in the decode buffer so far
    extra = random_prompt(rng, 3, h.vocab)
    full = x + h.out["X"] + extra
    h.extend([h.ereq("Y", full[len(prefix[0]) :], prefix=prefix)])
    for _ in range(DECODE_STEPS - 1):
        h.decode()
    assert h.out["Y"] == reference(h.path, full, DECODE_STEPS)
    assert h.out["X"] == reference(h.path, x, len(h.out["X"]))
    # and a second sharer arriving later, after more deferred decode steps of both
    prefix = h.prefix("X")
    full2 = x + h.out["X"] + extra
    h.extend([h.ereq("W", full2[len(prefix[0]) :], prefix=prefix)])
    for _ in range(3):
        h.decode()
    assert h.out["W"] == reference(h.path, full2, 4)
    h.release([ReleaseReq(rid, flush=True) for rid in list(h.running)])
    for rid in ("X", "Y", "W"):
        h.assert_pool_holds(rid)


# ---------------------------------------------------------------- 6. failure mode 2


@pytest.mark.parametrize("abort_in", ["extend", "decode"])
def test_aborted_request_slots_reused(model_path, abort_in):
    """Failure mode 2: an aborted request's deferred KV is dropped, never flushed into its
    old slots once another request owns them."""
    import mlx.core as mx

    h = Harness(model_path)
    rng = random.Random(9)
    x = random_prompt(rng, 8, h.vocab)
    z = random_prompt(rng, 14, h.vocab)
    h.extend([h.ereq("X", x), h.ereq("Z", z)])
    for _ in range(6):
        h.decode()
    abort = [ReleaseReq("X", flush=False)]
    y = random_prompt(rng, 9, h.vocab)
    if abort_in == "extend":
        freed = h.free("X")  # prompt and decode slots; X's decode slots are reused first
        h.extend([h.ereq("Y", y)], release=abort)
    else:
        h.decode(release=abort)  # Z alone now: the decode buffer is rebuilt
        # dropped, not flushed: X's decode slots were never written
        decode_slots = mx.array(h.slots["X"][len(x) :], dtype=mx.int32)
        for layer in range(h.pool.layout.num_layers):
            for rows in h.pool.gather(layer, decode_slots):
                assert not mx.any(rows).item()
        freed = h.free("X")
        h.extend([h.ereq("Y", y)])
    assert set(h.slots["Y"][:6]) == set(freed[len(x) :])  # Y took over X's decode slots
    for _ in range(DECODE_STEPS - 1):
        h.decode()  # Z and Y decode; later decode slots also come from X's freed ones
    h.release([ReleaseReq(rid, flush=True) for rid in list(h.running)])
    assert h.out["Y"] == reference(h.path, y, DECODE_STEPS)
    assert h.out["Z"] == reference(h.path, z, len(h.out["Z"]))
    h.assert_pool_holds("Y")
    h.assert_pool_holds("Z")
    # a third request on Y's KV as prefix sees Y's own KV
    prefix = h.prefix("Y")
    full = y + h.out["Y"]
    h.extend([h.ereq("W", full[len(prefix[0]) :], prefix=prefix)])
    for _ in range(4):
        h.decode()
    assert h.out["W"] == reference(h.path, full, 5)


def test_rid_reused_after_abort(model_path):
    """An aborted rid extended again with another prompt (as a retraction would) must not
    decode on the old request's buffered KV, even with the same decode membership."""
    h = Harness(model_path)
    rng = random.Random(13)
    x = random_prompt(rng, 7, h.vocab)
    z = random_prompt(rng, 10, h.vocab)
    h.extend([h.ereq("X", x), h.ereq("Z", z)])
    for _ in range(3):
        h.decode(["X", "Z"])
    x2 = random_prompt(rng, 12, h.vocab)
    h.free("X")
    h.out["X"] = []
    h.extend([h.ereq("X", x2)], release=[ReleaseReq("X", flush=False)])
    for _ in range(DECODE_STEPS - 1):
        h.decode(["X", "Z"])
    assert h.out["X"] == reference(h.path, x2, DECODE_STEPS)
    assert h.out["Z"] == reference(h.path, z, len(h.out["Z"]))


def test_finished_request_slots_reused(model_path):
    """X finished and flushed; its slots freed and reused by Y (extend) and by Z's decode
    steps must not be overwritten by any later flush."""
    h = Harness(model_path)
    rng = random.Random(10)
    x = random_prompt(rng, 6, h.vocab)
    z = random_prompt(rng, 9, h.vocab)
    h.extend([h.ereq("X", x), h.ereq("Z", z)])
    for _ in range(5):
        h.decode()
    h.decode(release=[ReleaseReq("X", flush=True)])  # X flushed, Z continues alone
    assert h.out["X"] == reference(h.path, x, 6)
    freed = h.free("X")
    for _ in range(3):
        h.decode()  # Z's decode slots now come from X's freed slots
    y = random_prompt(rng, 7, h.vocab)
    h.extend([h.ereq("Y", y)])  # more of X's old slots, and the flush of Z's deferred KV
    assert set(h.slots["Y"]) <= set(freed)
    assert set(h.slots["Z"][-3:]) <= set(freed)
    for _ in range(DECODE_STEPS - 1):
        h.decode()
    h.decode(["Y"], release=[ReleaseReq("Z", flush=True)])
    h.release([ReleaseReq("Y", flush=True)])
    assert h.out["Y"] == reference(h.path, y, DECODE_STEPS + 1)
    assert h.out["Z"] == reference(h.path, z, len(h.out["Z"]))
    h.assert_pool_holds("Y")
    h.assert_pool_holds("Z")


# ---------------------------------------------------------------- 7. pool sizing


def test_pool_layout_and_size(tiny_model, tiny_llama):
    from worker_mlx.kv_pool import MlxKVPool
    from worker_mlx.model_probe import probe_kv_layout

    for path in (tiny_model, tiny_llama):
        model, _ = load_model(path)
        layout = probe_kv_layout(model)
        args = model.args
        assert layout.num_layers == args.num_hidden_layers
        assert layout.n_kv_heads == args.num_key_value_heads
        n, kv, hd = layout.num_layers, layout.n_kv_heads, layout.head_dim
        assert layout.bytes_per_slot == 2 * n * kv * hd * layout.dtype.size
        pool = MlxKVPool(layout, 100)
        assert sum(a.nbytes for a in pool.arrays()) == 101 * layout.bytes_per_slot


def test_gather_by_heads_equals_gather_then_transpose():
    """The head-major gather that attention and the decode buffer use reads the same KV as
    a gather by slot followed by a transpose."""
    import mlx.core as mx

    from worker_mlx.kv_pool import KVLayout, MlxKVPool

    pool = MlxKVPool(KVLayout(num_layers=2, n_kv_heads=3, head_dim=8, dtype=mx.float32), 50)
    for layer in range(2):
        key = mx.random.key(layer)
        pool.write(layer, mx.arange(51), *mx.random.normal((2, 51, 3, 8), key=key))
    slots = mx.array([[0, 0, 7, 3, 50], [1, 2, 3, 4, 5]])
    for layer in range(2):
        want = [a.transpose(0, 2, 1, 3) for a in pool.gather(layer, slots)]
        got = pool.gather_heads(layer, pool.head_index(slots))
        assert all(g.shape == (2, 3, 5, 8) for g in got)
        assert all(mx.array_equal(g, w).item() for g, w in zip(got, want))


# ---------------------------------------------------------------- 8. seeded sampling


def test_seeded_sampling_is_reproducible(tiny_model):
    rng = random.Random(11)
    vocab = vocab_size(tiny_model)
    p = random_prompt(rng, 12, vocab)
    others = {f"o{i}": random_prompt(rng, rng.randint(1, 20), vocab) for i in range(3)}

    alone = generate(Harness(tiny_model, seed=0), {"s": p}, 10, {"s": seeded(1234)})["s"]

    # same seed, batched with greedy, unseeded and differently seeded requests, at another
    # position, on a runner with another worker seed
    prompts = {"o0": others["o0"], "o1": others["o1"], "s": p, "o2": others["o2"]}
    sampling = {"o0": seeded(None), "o1": greedy(10), "s": seeded(1234), "o2": seeded(99)}
    batched = generate(Harness(tiny_model, seed=5), prompts, 10, sampling)
    assert batched["s"] == alone
    assert batched["o1"] == reference(tiny_model, others["o1"], 10)

    again = generate(Harness(tiny_model, seed=0), {"s": p}, 10, {"s": seeded(1234)})["s"]
    assert again == alone
    other_seed = generate(Harness(tiny_model, seed=0), {"s": p}, 10, {"s": seeded(4321)})["s"]
    assert other_seed != alone
    # top_k 0 is off, as in mlx-lm and vLLM: the same tokens as the default -1
    no_top_k = dataclasses.replace(seeded(1234), top_k=0)
    assert generate(Harness(tiny_model, seed=0), {"s": p}, 10, {"s": no_top_k})["s"] == alone


def test_a_seeded_request_resumed_after_retraction_goes_on_as_before(tiny_model):
    """A retracted request comes back as a prefill of its prompt and outputs so far
    (`output_ids`); its next tokens are those it would have sampled without the pause."""
    rng = random.Random(13)
    h = Harness(tiny_model, seed=0)
    p = random_prompt(rng, 12, h.vocab)
    whole = generate(h, {"s": p}, 10, {"s": seeded(77)})["s"]
    h = Harness(tiny_model, seed=0)
    req = h.ereq("s", p + whole[:4], sampling=seeded(77, n=6))
    req.output_ids = whole[:4]
    h.extend([req])
    while len(h.out["s"]) < 6:
        h.decode()
    assert h.out["s"] == whole[4:]


# ---------------------------------------------------------------- 9. bad descriptors


def test_bad_descriptors_raise_and_leave_runner_usable(tiny_model):
    h = Harness(tiny_model, num_slots=256)
    rng = random.Random(12)
    x = random_prompt(rng, 9, h.vocab)
    h.extend([h.ereq("X", x)])
    h.decode()
    h.decode()

    def bad_extend(message: str, **kw) -> None:
        fields = dict(
            rid="bad",
            input_ids=[1, 2, 3],
            prefix_slot_ids=[],
            out_cache_loc=[200, 201, 202],
            sampling=greedy(),
        )
        fields.update(kw)
        good = ExtendReq("good", [4, 5], [], [203, 204], greedy())
        with pytest.raises(ValueError, match=message):
            h.runner.extend(ExtendBatch(99, [good, ExtendReq(**fields)]))
        assert "bad" not in h.runner.decodings and "good" not in h.runner.decodings

    bad_extend("slot id outside the pool", out_cache_loc=[200, 0, 202])
    bad_extend("slot id outside the pool", out_cache_loc=[200, 201, 257])
    bad_extend("slot id outside the pool", prefix_slot_ids=[0])
    bad_extend("slot id outside the pool", prefix_slot_ids=[257])
    bad_extend("3 tokens but 2 slots", out_cache_loc=[200, 201])
    bad_extend("token id outside the vocabulary", input_ids=[1, h.vocab, 3])
    bad_extend("token id outside the vocabulary", input_ids=[-1, 2, 3])
    bad_extend("no input tokens", input_ids=[], out_cache_loc=[])
    bad_extend("already decoding", rid="X")
    bad_extend("temperature", sampling=SamplingParams(temperature=-1.0))

    def bad_decode(message: str, rids: list[str], locs: list[int]) -> None:
        with pytest.raises(ValueError, match=message):
            h.runner.decode(DecodeBatch(99, rids, locs))

    bad_decode("unknown requests", ["X", "nobody"], [210, 211])
    bad_decode("2 requests but 1 slots", ["X", "X2"], [210])
    bad_decode("slot id outside the pool", ["X"], [0])
    bad_decode("slot id outside the pool", ["X"], [257])

    # X is unharmed and keeps decoding, and a new request next to it still works
    y = random_prompt(rng, 5, h.vocab)
    h.extend([h.ereq("Y", y)])
    for _ in range(5):
        h.decode()
    assert h.out["X"] == reference(tiny_model, x, 8)
    assert h.out["Y"] == reference(tiny_model, y, 6)


def test_every_layer_cache_follows_the_cache_protocol(tiny_model):
    """Probe, extend and decode-step caches are what mlx-lm layers call: one protocol."""
    import mlx.core as mx

    from worker_mlx.extend_pass import ExtendPlan
    from worker_mlx.kv_pool import MlxKVPool
    from worker_mlx.layer_caches import LayerCache, ProbeCache, StepCache, StepColumns
    from worker_mlx.model_probe import probe_kv_layout

    pool = MlxKVPool(probe_kv_layout(load_model(tiny_model)[0]), 16)
    extend = ExtendPlan(pool, [[1, 2]], [3], [[3, 4, 5]]).layer_caches()
    kv = mx.zeros((1, 2, 8, 4))
    zero = mx.array([0])
    step = StepCache(zero, StepColumns(zero, zero, 8, 0), kv, kv, 16)
    for cache in [ProbeCache(), *extend, step]:
        assert isinstance(cache, LayerCache), type(cache).__name__
    assert not isinstance(object(), LayerCache)


def _failing_step(*args, **kwargs):
    raise RuntimeError("step failed")


def test_a_failed_one_token_extend_leaves_no_request_behind(tiny_model, monkeypatch):
    """A one-token extend (a repeated prompt) whose step raises registers nothing: the
    same request extended again works and matches mlx-lm."""
    h = Harness(tiny_model)
    rng = random.Random(15)
    prompt = random_prompt(rng, 20, h.vocab)
    assert generate(h, {"A": prompt}, 3)["A"] == reference(h.path, prompt, 3)
    req = h.ereq("A2", prompt[-1:], prefix=h.prefix("A", len(prompt) - 1))
    from worker_mlx.decode_buffer import DecodeBuffer

    with monkeypatch.context() as patched:
        patched.setattr(DecodeBuffer, "step", _failing_step)  # the step cannot run
        with pytest.raises(RuntimeError, match="step failed"):
            h.runner.extend(ExtendBatch(99, [req]))
    assert "A2" not in h.runner.decodings
    h.extend([req])
    for _ in range(DECODE_STEPS - 1):
        h.decode()
    assert h.out["A2"] == reference(h.path, prompt, DECODE_STEPS)
