"""Worker sampling against references: logprobs, penalties, and the per-request fallback."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from common.messages import DecodeBatch, ExtendBatch, ExtendReq, ReleaseReq, SamplingParams
from tests.conftest import load_model, mlx_greedy
from worker_mlx.kv_pool import MlxKVPool
from worker_mlx.model_probe import probe_kv_layout
from worker_mlx.model_runner import ModelRunner
from worker_mlx.self_check import batched_path_works
from worker_mlx.worker import _run_ahead

PROMPTS = [[5, 17, 99, 230, 41, 8], [300, 12], [77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87]]


def _runner(path: str, batched: bool = True) -> ModelRunner:
    model, _ = load_model(path)
    return ModelRunner(model, MlxKVPool(probe_kv_layout(model), 512), 512, batched=batched)


def _generate(runner: ModelRunner, prompts, params: SamplingParams, n: int):
    """Run prompts as one batch for n tokens; returns per-request step outputs."""
    slots = iter(range(1, 513))
    reqs = [
        ExtendReq(f"r{i}", p, [], [next(slots) for _ in p], params) for i, p in enumerate(prompts)
    ]
    outs = [runner.extend(ExtendBatch(0, reqs))]
    rids = [r.rid for r in reqs]
    for step in range(1, n):
        outs.append(runner.decode(DecodeBatch(step, rids, [next(slots) for _ in rids])))
    runner.release([ReleaseReq(rid, flush=False) for rid in rids])
    return outs


def test_logprobs_equal_log_softmax_of_mlx_lm_logits(tiny_model):
    from mlx_lm.generate import generate_step

    model, _ = load_model(tiny_model)
    params = SamplingParams(temperature=0, logprobs=True, top_logprobs=5)
    outs = _generate(_runner(tiny_model), PROMPTS, params, 6)
    for row, prompt in enumerate(PROMPTS):
        steps = generate_step(mx.array(prompt), model, max_tokens=6, sampler=lambda x: x.argmax(-1))
        for out, (tok, ref) in zip(outs, steps):
            ref = np.array(ref.astype(mx.float32))
            assert out.next_token_ids[row] == int(tok)
            assert abs(out.logprobs[row] - ref[int(tok)]) < 1e-4
            top = out.top_logprobs[row]
            assert len(top) == 5
            assert [i for i, _ in top] == list(np.argsort(-ref)[:5])
            assert max(abs(v - ref[i]) for i, v in top) < 1e-4


def _reference_penalized_greedy(path, prompt, n, rep, freq, pres):
    """Full recompute each step, penalties applied in numpy: slow but obviously right."""
    model, _ = load_model(path)
    seq, out = list(prompt), []
    for _ in range(n):
        logits = np.array(model(mx.array([seq]))[0, -1].astype(mx.float32))
        for t in set(seq):
            logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
        for t in set(out):
            logits[t] -= freq * out.count(t) + pres
        tok = int(np.argmax(logits))
        seq.append(tok)
        out.append(tok)
    return out


@pytest.mark.parametrize("rep,freq,pres", [(1.3, 0.0, 0.0), (1.0, 0.8, 0.5), (0.7, -0.5, 1.0)])
def test_penalties_match_reference(tiny_model, rep, freq, pres):
    params = SamplingParams(
        temperature=0, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres
    )
    outs = _generate(_runner(tiny_model), PROMPTS, params, 10)
    for row, prompt in enumerate(PROMPTS):
        got = [o.next_token_ids[row] for o in outs]
        assert got == _reference_penalized_greedy(tiny_model, prompt, 10, rep, freq, pres)


def test_logit_bias_matches_mlx_lm(tiny_model):
    """A bias that bans each prompt's greedy first token and favours another changes the
    greedy output exactly as mlx-lm's own logit-bias processor does."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    model, _ = load_model(tiny_model)
    banned = {mlx_greedy(tiny_model, p, 1)[0] for p in PROMPTS}
    bias = {t: -100.0 for t in banned} | {42: 4.0}
    params = SamplingParams(temperature=0, logit_bias=bias)  # int keys, as SDK users write
    assert params.logit_bias == {str(t): b for t, b in bias.items()}
    outs = _generate(_runner(tiny_model), PROMPTS, params, 8)
    processors = make_logits_processors(logit_bias=bias)
    for row, prompt in enumerate(PROMPTS):
        steps = generate_step(
            mx.array(prompt), model, max_tokens=8, sampler=lambda x: x.argmax(-1),
            logits_processors=processors,
        )  # fmt: skip
        want = [int(tok) for tok, _ in steps]
        assert [o.next_token_ids[row] for o in outs] == want
        assert not banned & set(want)


def test_penalties_use_cached_context_and_resumed_outputs(tiny_model):
    """With a cached prefix the worker learns the prefix tokens from context_ids."""
    runner = _runner(tiny_model)
    prompt = PROMPTS[2]
    params = SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=1.0)
    first = runner.extend(ExtendBatch(0, [ExtendReq("a", prompt, [], list(range(1, 12)), params)]))
    runner.release([ReleaseReq("a", flush=True)])
    tok = first.next_token_ids[0]
    # resume as a retracted request would: prompt + [tok] with the prompt's KV cached
    req = ExtendReq(
        "b", [tok], list(range(1, 12)), [20], params, context_ids=prompt, output_ids=[tok]
    )
    outs = [runner.extend(ExtendBatch(1, [req]))]
    for step in range(2, 6):
        outs.append(runner.decode(DecodeBatch(step, ["b"], [19 + step])))
    got = [tok] + [o.next_token_ids[0] for o in outs]
    assert got == _reference_penalized_greedy(tiny_model, prompt, 6, 1.5, 1.0, 0.0)


class _IntOnlyRope:
    """A RoPE that only takes integer offsets, like some model ports do."""

    def __init__(self, rope):
        self.rope = rope

    def __call__(self, x, offset=0):
        if isinstance(offset, mx.array):
            raise TypeError("offset must be an int")
        return self.rope(x, offset=offset)


def test_per_request_fallback_is_detected_and_exact(tiny_llama):
    from mlx_lm import load

    model, _ = load(tiny_llama)
    layout = probe_kv_layout(model)
    assert batched_path_works(model, layout, 512)
    for layer in model.model.layers:
        layer.self_attn.rope = _IntOnlyRope(layer.self_attn.rope)
    assert not batched_path_works(model, layout, 512)
    runner = ModelRunner(model, MlxKVPool(layout, 512), 512, batched=False)
    outs = _generate(runner, PROMPTS, SamplingParams(temperature=0), 8)
    for row, prompt in enumerate(PROMPTS):
        assert [o.next_token_ids[row] for o in outs] == mlx_greedy(tiny_llama, prompt, 8)


def test_prefill_projects_only_last_positions(tiny_model, tiny_llama):
    """Tied (qwen3) and untied (llama) heads both split off the body."""
    from worker_mlx.model_probe import split_lm_head

    for path in (tiny_model, tiny_llama):
        model, _ = load_model(path)
        body, head = split_lm_head(model)
        assert body is model.model
        x = mx.array([[4, 5, 6, 7]])
        assert mx.allclose(head(body(x))[:, -1], model(x)[:, -1], atol=1e-5).item()


@pytest.mark.parametrize("batched", [True, False])
def test_prefill_in_rounds_matches_mlx_lm(tiny_model, batched):
    """Prompts longer than the prefill step run in rounds; short rows drop out early."""
    model, _ = load_model(tiny_model)
    runner = ModelRunner(
        model, MlxKVPool(probe_kv_layout(model), 512), 512, batched=batched, prefill_step=16
    )
    prompts = [list(range(3, 73)), [9, 8, 7], list(range(100, 141))]
    outs = _generate(runner, prompts, SamplingParams(temperature=0), 6)
    for row, prompt in enumerate(prompts):
        assert [o.next_token_ids[row] for o in outs] == mlx_greedy(tiny_model, prompt, 6)


def test_lookahead_steps_match_mlx_lm_and_are_undone_when_unused(tiny_model):
    """Decode steps computed ahead are used when the next descriptor matches and undone
    when it does not: a release, an extend in between, a different request set."""
    runner = _runner(tiny_model)
    slots = iter(range(1, 513))
    greedy = SamplingParams(temperature=0)

    def extend(rid, prompt, step):
        req = ExtendReq(rid, prompt, [], [next(slots) for _ in prompt], greedy)
        out = runner.extend(ExtendBatch(step, [req]))
        runner.run_ahead()
        return out.next_token_ids

    def decode(rids, step, release=()):
        batch = DecodeBatch(step, rids, [next(slots) for _ in rids], list(release), True)
        out = runner.decode(batch)
        runner.run_ahead()
        return out.next_token_ids

    got = {"a": extend("a", PROMPTS[0], 0), "b": extend("b", PROMPTS[1], 1)}
    step = 2
    for n in range(12):  # same set (used), then an extend and a release (both undone)
        if n == 4:
            got["c"] = extend("c", PROMPTS[2], step)
            step += 1
        rids = [r for r in ("a", "b", "c") if r in got and not (r == "b" and n >= 8)]
        release = [ReleaseReq("b", flush=True)] if n == 8 else []
        for rid, tok in zip(rids, decode(rids, step, release)):
            got[rid].append(tok)
        step += 1
    for rid, prompt in zip("abc", PROMPTS):
        assert got[rid] == mlx_greedy(tiny_model, prompt, len(got[rid])), rid


def test_a_held_step_is_not_computed_ahead(tiny_model):
    """The worker's rule after a decode step sent with `lookahead`: held (the scheduler
    sent something during it: a prompt came), nothing is computed ahead; otherwise the
    next step is, and the descriptor that follows takes it, exact."""
    runner = _runner(tiny_model)
    greedy = SamplingParams(temperature=0)
    out = runner.extend(
        ExtendBatch(0, [ExtendReq("a", PROMPTS[2], [], list(range(1, 12)), greedy)])
    )
    got = out.next_token_ids
    for step, held in ((1, True), (2, False), (3, False)):
        got += runner.decode(DecodeBatch(step, ["a"], [20 + step], [], True)).next_token_ids
        _run_ahead(runner, held)
        assert runner.lookahead.has_step is not held
    assert got == mlx_greedy(tiny_model, PROMPTS[2], 4)
