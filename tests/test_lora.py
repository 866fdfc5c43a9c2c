"""LoRA adapters per request: the worker's batched per-row adapters against mlx-lm's own
adapter generation, the scheduler's namespaces and per-batch limit, and the checks of
`--lora` (tests/test_lora_e2e.py runs them behind a real server)."""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest

from common.lora_adapters import LoraSpec, adapter_problem, check_loras, parse_lora_flags
from common.messages import GenerateReq, ReleaseReq, SamplingParams
from tests.test_model_runner import Harness, greedy, random_prompt
from tests.test_scheduler_policy import make_scheduler, run_step

STEPS = 10


@functools.cache
def _adapter_model(model: str, adapter: str | None):
    from mlx_lm import load

    return load(model, adapter_path=adapter)[0]


def adapter_greedy(model: str, adapter: str | None, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own greedy tokens of `prompt` with `adapter` applied (None: the base)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    sampler = lambda x: mx.argmax(x, -1)  # noqa: E731
    steps = generate_step(mx.array(prompt), _adapter_model(model, adapter), max_tokens=n,
                          sampler=sampler)  # fmt: skip
    return [int(tok) for tok, _ in steps]


def lora_harness(tiny_model: str, adapters: list[str], compile_decode: bool) -> Harness:
    """A runner over a model of its own, its layers wrapped by a bank of `adapters`."""
    from mlx_lm import load

    from worker_mlx.lora import make_bank

    model, _ = load(tiny_model)
    bank = make_bank(model, [LoraSpec(f"a{i + 1}", p) for i, p in enumerate(adapters)])
    # prefill passes of 16 tokens: rows of 3 to 30 tokens take one or two rounds
    return Harness(
        tiny_model, model=model, lora=bank, compile_decode=compile_decode, prefill_step=16
    )


def _start(h: Harness, prompts: dict[str, list[int]], lora: dict[str, int]) -> None:
    h.extend([dataclasses.replace(h.ereq(rid, p, sampling=greedy()), lora=lora[rid])
              for rid, p in prompts.items()])  # fmt: skip


@pytest.mark.parametrize("compile_decode", [True, False], ids=["compiled", "eager"])
def test_a_batch_mixing_base_rows_and_two_adapters_matches_mlx_lm_row_by_row(
    tiny_model, tiny_adapters, compile_decode
):
    """One prefill and one decode step per step for all rows: base rows and rows of two
    adapters, each token-exact against mlx-lm with that adapter (or none); a row of each
    joins later, taking dead rows of the decode buffer."""
    h = lora_harness(tiny_model, tiny_adapters, compile_decode)
    rng = random.Random(7)
    lora = {f"r{i}": i % 3 for i in range(9)}
    prompts = {rid: random_prompt(rng, rng.randint(3, 30), h.vocab) for rid in lora}
    first = dict(list(prompts.items())[:6])
    _start(h, first, lora)
    for _ in range(3):
        h.decode()
    h.release([ReleaseReq("r0", flush=True)])  # its row goes dead; a joining row takes it
    _start(h, dict(list(prompts.items())[6:]), lora)
    while any(len(h.out[rid]) < STEPS for rid in h.running):
        h.decode()
    for rid, prompt in prompts.items():
        path = tiny_adapters[lora[rid] - 1] if lora[rid] else None
        got = h.out[rid]
        assert got == adapter_greedy(tiny_model, path, prompt, len(got)), rid
    base = adapter_greedy(tiny_model, None, prompts["r1"], STEPS)
    assert h.out["r1"] != base  # the adapter changes the tokens: the test can tell them apart


def test_an_adapter_of_another_base_is_refused_with_what_differs(
    tiny_model, tiny_adapters, model_cache
):
    from common.tiny_model import ensure_tiny_model

    assert adapter_problem(tiny_model, tiny_adapters[0]) is None
    other = str(ensure_tiny_model(model_cache, preset="small"))
    problem = adapter_problem(other, tiny_adapters[0])
    assert "an adapter of another base" in problem and "64 -> 64" in problem
    with pytest.raises(ValueError, match="--lora x=.*cannot serve this adapter"):
        check_loras(other, [LoraSpec("x", tiny_adapters[0])])
    assert "no adapter_config.json" in adapter_problem(tiny_model, tiny_model)


@pytest.mark.parametrize(
    "flags, error",
    [
        (["a"], "expected NAME=PATH"),
        (["=/x"], "expected NAME=PATH"),
        (["a=/x", "a=/y"], "given twice"),
        (["m=/x"], "other than the model's"),
        (["b:c=/x", "c=/y"], "given twice"),
    ],
)
def test_bad_lora_flags_name_the_flag(flags, error):
    with pytest.raises(ValueError, match=error):
        parse_lora_flags(flags, ["m"])
    assert [s.name for s in parse_lora_flags(["a=/x", "b=/y"], ["m"])] == ["a", "b"]
    # BASE:NAME=PATH names the model it adapts (a base's name may hold ':')
    assert parse_lora_flags(["q:8b:c=/x"], ["m"]) == [LoraSpec("c", "/x", "q:8b")]


# ---------------------------------------------------------------- the scheduler

PROMPT = list(range(10, 50))


def _serve(s, rid: str, lora: int) -> int:
    """Run one request to its end; its cached_tokens."""
    sampling = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    s.on_request(GenerateReq(rid, PROMPT, sampling, lora=lora))
    outs = []
    while s.busy:
        run_step(s)
        outs += [o for o in s.take_outputs() if o.rid == rid]
    assert outs and outs[-1].finish_reason == "length"
    return outs[0].cached_tokens


def test_prefixes_are_shared_within_one_adapter_only():
    s = make_scheduler(lora=["a=/x", "b=/y"])
    assert _serve(s, "a1", 1) == 0
    assert _serve(s, "b1", 2) == 0
    assert _serve(s, "base1", 0) == 0
    assert _serve(s, "a2", 1) == len(PROMPT) - 1
    assert _serve(s, "base2", 0) == len(PROMPT) - 1
    s.check_invariants()


def test_an_unknown_adapter_id_is_refused():
    s = make_scheduler(lora=["a=/x"])
    s.on_request(GenerateReq("r", PROMPT, SamplingParams(max_new_tokens=2), lora=2))
    (err,) = s.take_outputs()
    assert err.code == "model_not_found" and err.status == 404 and "id 2" in err.message


def test_an_unload_waits_for_the_adapters_requests_and_refuses_new_ones():
    """scheduler/lora_updates.py: an unload is held while a request of its adapter runs
    (the process takes updates between steps), a new request of it is refused at once,
    and a load of an id in use is refused; a load serves once the worker answered."""
    from common.messages import LoraUpdate, LoraUpdated

    s = make_scheduler(lora=["a=/x"])
    updates = s.lora_updates
    sampling = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    s.on_request(GenerateReq("r", PROMPT, sampling, lora=1))
    run_step(s)
    s.on_request(LoraUpdate("u1", 1, "a"))
    s.on_request(GenerateReq("late", PROMPT, sampling, lora=1))
    (refused,) = [o for o in s.take_outputs() if o.rid == "late"]
    assert "id 1" in refused.message
    assert updates.take(s.reqs.values()) is None  # "r" still runs
    while "r" in s.reqs:
        run_step(s)
    unload = updates.take(s.reqs.values())
    assert unload.rid == "u1" and updates.done(unload, LoraUpdated("u1", 1)).error == ""
    s.on_request(LoraUpdate("u2", 2, "b", "/y"))
    s.on_request(LoraUpdate("u3", 2, "c", "/z"))
    (taken,) = [o for o in s.take_outputs() if isinstance(o, LoraUpdated)]
    assert taken.rid == "u3" and "in use" in taken.error
    load = updates.take(s.reqs.values())
    assert not updates.serves(2)
    updates.done(load, LoraUpdated("u2", 2))
    assert updates.serves(2) and not updates.serves(1)


def test_a_batch_holds_at_most_max_loras_per_batch_adapters():
    s = make_scheduler(lora=["a=/x", "b=/y", "c=/z"], max_loras_per_batch=2)
    sampling = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    for i, lora in enumerate([1, 2, 3, 0, 1]):
        s.on_request(GenerateReq(f"r{i}", [5 + i] * 8, sampling, lora=lora))
    first = run_step(s)
    assert sorted(r.lora for r in first.reqs) == [0, 1, 1, 2]  # adapter 3 waits
    seen = []
    while s.busy:
        batch = run_step(s)
        rows = getattr(batch, "reqs", None)
        if rows is not None:
            seen.append({r.lora for r in rows})
        s.take_outputs()
    assert {3} in seen  # once the others ended


def test_adapters_of_other_ranks_and_layers_share_a_batch(tiny_model, tiny_adapters, model_cache):
    """A rank-2 adapter of the MLP's down_proj and o_proj in the last layer beside a
    rank-4 one of q_proj and v_proj: each layer's stack pads the smaller rank and holds
    zeros for the adapter that leaves it alone; every row stays token-exact."""
    from pathlib import Path

    from common.tiny_adapter import build_tiny_adapter

    keys = ("mlp.down_proj", "self_attn.o_proj")
    other = str(build_tiny_adapter(tiny_model, Path(model_cache) / "lora-tiny-mlp", seed=3,
                                   rank=2, num_layers=1, keys=keys))  # fmt: skip
    h = lora_harness(tiny_model, [tiny_adapters[0], other], compile_decode=True)
    rng = random.Random(8)
    lora = {f"r{i}": i % 3 for i in range(6)}
    prompts = {rid: random_prompt(rng, rng.randint(3, 30), h.vocab) for rid in lora}
    _start(h, prompts, lora)
    for _ in range(STEPS - 1):
        h.decode()
    for rid, prompt in prompts.items():
        path = [None, tiny_adapters[0], other][lora[rid]]
        assert h.out[rid] == adapter_greedy(tiny_model, path, prompt, STEPS), rid


def test_lora_with_speculation_or_a_distributed_worker_is_refused():
    from common.server_args import ServerArgs

    for extra in ({"speculative_algorithm": "ngram"}, {"tp_size": 2}):
        args = ServerArgs(model_path="m", lora=["a=/x"], **extra)
        with pytest.raises(ValueError, match="--lora with"):
            args.validate()
    with pytest.raises(ValueError, match="--max-loras-per-batch"):
        ServerArgs(model_path="m", max_loras_per_batch=0).validate()


def test_prompt_logprobs_of_an_adapter_row_are_the_adapters(tiny_model, tiny_adapters):
    """The prompt's own logprobs run the prompt once more: with the row's adapter, so
    they are log_softmax of mlx-lm's logits with that adapter applied."""
    import mlx.core as mx

    from common.messages import ExtendBatch

    h = lora_harness(tiny_model, tiny_adapters, compile_decode=True)
    asks = SamplingParams(temperature=0, max_new_tokens=2, prompt_logprobs=True)
    prompt = [(13 * i + 5) % h.vocab for i in range(20)]
    rows = [dataclasses.replace(h.ereq(f"p{i}", prompt, sampling=asks), lora=i) for i in (0, 2)]
    out = h.runner.extend(ExtendBatch(1, rows))
    for got, adapter in zip(out.prompt_logprobs, [None, tiny_adapters[1]]):
        logits = _adapter_model(tiny_model, adapter)(mx.array([prompt]))[0]
        lp = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).tolist()
        want = [lp[i][prompt[i + 1]] for i in range(len(prompt) - 1)]
        assert all(abs(g[0] - w) < 1e-4 for g, w in zip(got, want))
    assert abs(out.prompt_logprobs[0][3][0] - out.prompt_logprobs[1][3][0]) > 1e-3


def test_adapter_names_go_before_alias_globs():
    from router.api.model_names import ModelNames

    names = ModelNames(["m"], ["*"], "/models/m", ["a", "b"])
    assert [names.adapter(n) for n in ("a", "m:b", "b", "m", "claude-x", None)] == [
        1,
        2,
        2,
        0,
        0,
        0,
    ]
    assert names.reported_for("m:b") == "b" and names.reported_for("claude-x") == "m"
    strict = ModelNames(["m"], [], "/models/m", ["a"])
    assert strict.adapter("x:a") is None and strict.adapter("c") is None


def test_adapters_load_and_unload_while_rows_decode(tiny_model, tiny_adapters):
    """A runner that started with no adapter (the runtime bank) loads one between steps
    while a base row decodes, serves a row of it beside that row, unloads it, and serves a
    row of another adapter loaded in the same stack row: every row token-exact. The
    compiled step is traced afresh at each change (it holds the stacks as constants: a
    stale trace would run the first adapter's factors for the second)."""
    from mlx_lm import load

    from common.messages import LoraUpdate
    from worker_mlx.lora import make_bank

    model, _ = load(tiny_model)
    h = Harness(tiny_model, model=model, lora=make_bank(model, [], runtime=True),
                compile_decode=True, prefill_step=16)  # fmt: skip
    rng = random.Random(11)
    prompts = {rid: random_prompt(rng, 12, h.vocab) for rid in ("base", "one", "two")}
    _start(h, {"base": prompts["base"]}, {"base": 0})
    h.decode()
    for rid, lora, path in (("one", 1, tiny_adapters[0]), ("two", 2, tiny_adapters[1])):
        answer = h.runner.update_lora(LoraUpdate("u", lora, rid, path))
        assert answer.error == "" and answer.held_delta > 0  # for --max-memory's admission
        _start(h, {rid: prompts[rid]}, {rid: lora})
        for _ in range(4):
            h.decode()
        h.release([ReleaseReq(rid, flush=True)])
        unloaded = h.runner.update_lora(LoraUpdate("u", lora, rid))
        assert unloaded.error == "" and unloaded.held_delta < 0
        assert h.out[rid] == adapter_greedy(tiny_model, path, prompts[rid], len(h.out[rid]))
    assert h.out["base"] == adapter_greedy(tiny_model, None, prompts["base"], len(h.out["base"]))
    refused = h.runner.update_lora(LoraUpdate("u", 3, "x", tiny_model))
    assert refused.error.startswith("LoRA adapter x: ") and "adapter_config.json" in refused.error


def test_adapters_loaded_at_run_time_count_against_the_memory_budget():
    """The worker's LoraUpdated says what its adapters hold more (or less) now; the
    scheduler's admission (--max-memory) counts it with the weights and pools."""
    from common.messages import MemoryReport, WorkerReady
    from common.server_args import ServerArgs
    from scheduler.scheduler import Scheduler

    report = MemoryReport(budget=10_000, fixed=4_000, kv_token_bytes=1, score_bytes=1,
                          act_token_bytes=1, row_bytes=1, prefill_step=16)  # fmt: skip
    ready = WorkerReady(4096, "test", 2, 2, 8, "float32", 4096, 1000, [0], "none", memory=report)
    s = Scheduler(ServerArgs(model_path="in-process"), ready)
    s.adapters_changed(1_500)
    assert s.memory.headroom == 4_500
    s.adapters_changed(-1_500)
    assert s.memory.headroom == 6_000


def test_one_models_adapter_base_must_be_that_model():
    from common.server_args import ServerArgs

    for base in ("m", "/models/m"):  # a served name, or the path as given
        ServerArgs(model_path="/models/m", lora=[f"{base}:a=/p"]).validate()
    with pytest.raises(ValueError, match="--lora other:a=/p: no model 'other'; serving 'm'"):
        ServerArgs(model_path="/models/m", lora=["other:a=/p"]).validate()
