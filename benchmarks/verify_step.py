"""A speculative verify step's cost against a plain decode step, through the ModelRunner.

    python -m benchmarks.verify_step [--preset small] [--batch-size 1 8] [--k 4] \
        [--prompt-len 256] [--pairs 40] [--draft-model P]

Per batch size: prompts of --prompt-len random tokens are prefilled into two runners;
then a plain decode step of one (no speculation) alternates with a verify step of K
drafts per row of the other (ABAB, so load from other processes falls on both alike).
The drafts are the rows' own greedy continuation (taken from a first pass), so every
draft is accepted: the step of a row whose drafts hold. Each step is timed until its
tokens are on the host, as the worker answers. Prints the median step times, the median
of the per-pair ratios (verify ÷ decode) and the tokens per second against decode's;
with --draft-model the second runner has that draft model, which proposes the drafts
(the whole draft-model step: K + 1 draft steps and the verify).
"""

from __future__ import annotations

import argparse
import statistics
import time

from common.tiny_presets import PRESETS
from worker_mlx.backends.blas import preload_openblas

BLAS = preload_openblas()

import mlx.core as mx  # noqa: E402

from benchmarks.one_batch import SlotList, _preset_model  # noqa: E402
from common.messages import DecodeBatch, ExtendBatch, ExtendReq, SamplingParams  # noqa: E402
from worker_mlx.backends import select  # noqa: E402
from worker_mlx.kv_pool import MlxKVPool  # noqa: E402
from worker_mlx.model_probe import probe_kv_layout  # noqa: E402
from worker_mlx.model_runner import ModelRunner  # noqa: E402
from worker_mlx.proposer import SchedulerDrafts  # noqa: E402
from worker_mlx.speculation import Verifier  # noqa: E402

GREEDY = SamplingParams(max_new_tokens=1 << 20, temperature=0, ignore_eos=True)


def _runner(model, vocab: int, slots: int, draft=None) -> Verifier:
    """A Verifier around the target's runner, as the loader builds it: with the draft
    model as its proposer, else the scheduler's drafts."""
    backend = select()
    proposer = SchedulerDrafts()
    if draft is not None:
        from worker_mlx.draft_model import DraftModel

        pool = MlxKVPool(probe_kv_layout(draft), slots)
        proposer = DraftModel(
            ModelRunner(draft, pool, vocab, compile_decode=backend.compile_decode)
        )
    runner = ModelRunner(
        model, MlxKVPool(probe_kv_layout(model), slots), vocab,
        prefill_step=backend.prefill_step, compile_decode=backend.compile_decode,
    )  # fmt: skip
    return Verifier(runner, proposer)


def _start(runner: Verifier, slots: SlotList, prompts: list[list[int]]) -> dict:
    rids = [f"r{i}" for i in range(len(prompts))]
    reqs = [ExtendReq(r, p, [], slots.take(len(p)), GREEDY) for r, p in zip(rids, prompts)]
    out = runner.extend(ExtendBatch(0, reqs))
    return {rid: [tok] for rid, tok in zip(out.rids, out.next_token_ids)}


def _plain(runner: Verifier, slots: SlotList, outs: dict, step: int) -> None:
    rids = list(outs)
    res = runner.decode(DecodeBatch(step, rids, slots.take(len(rids))))
    for rid, tok in zip(rids, res.next_token_ids):
        outs[rid].append(tok)


def _verify(runner, slots, outs: dict, want: dict, k: int, step: int, worker_drafts: bool):
    rids = list(outs)
    drafts = [want[rid][len(outs[rid]) : len(outs[rid]) + k] for rid in rids]
    batch = DecodeBatch(
        step, rids, slots.take(len(rids)),
        drafts=[[] for _ in rids] if worker_drafts else drafts,
        draft_slots=[slots.take(k) for _ in rids], worker_drafts=worker_drafts,
    )  # fmt: skip
    res = runner.decode(batch)
    proposed = res.proposed if worker_drafts else drafts
    for i, rid in enumerate(rids):
        outs[rid] += proposed[i][: res.accepted[i]] + [res.next_token_ids[i]]
    return sum(res.accepted)


def measure(model, vocab, bs: int, args: argparse.Namespace, draft=None) -> dict:
    """Median step times of plain decode (a runner without speculation) and of verify
    steps (another runner, fed the same prompts), alternating; the median pair ratio; and
    drafts accepted per row and verify step."""
    rng = __import__("random").Random(bs)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(bs)]
    n_out = (args.pairs + 3) * (args.k + 2)  # the warm-up pairs too
    size = bs * (args.prompt_len + 2 * n_out) + 64
    plain, plain_slots = _runner(model, vocab, size), SlotList(size)
    want = _start(plain, plain_slots, prompts)
    for step in range(1, n_out):
        _plain(plain, plain_slots, want, step)
    plain, plain_slots = _runner(model, vocab, size), SlotList(size)
    spec, spec_slots = _runner(model, vocab, size, draft), SlotList(size)
    base, outs = _start(plain, plain_slots, prompts), _start(spec, spec_slots, prompts)
    times = {"decode": [], "verify": []}
    kept = 0
    for pair in range(args.pairs + 2):  # the first two pairs warm up (compiles per shape)
        t0 = time.perf_counter()
        _plain(plain, plain_slots, base, pair + 1)
        t1 = time.perf_counter()
        a = _verify(spec, spec_slots, outs, want, args.k, pair + 1, draft is not None)
        t2 = time.perf_counter()
        if pair >= 2:
            times["decode"].append(t1 - t0)
            times["verify"].append(t2 - t1)
            kept += a
    for rid in outs:  # the speculative outputs are the plain greedy ones
        assert outs[rid] == want[rid][: len(outs[rid])], rid
    ratios = [v / d for d, v in zip(times["decode"], times["verify"])]
    return {
        "batch": bs,
        "decode_ms": 1e3 * statistics.median(times["decode"]),
        "verify_ms": 1e3 * statistics.median(times["verify"]),
        "ratio": statistics.median(ratios),
        "accepted": kept / (bs * args.pairs),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    from mlx_lm import load

    path = args.model_path or str(_preset_model(args.preset))
    model, _ = load(path)
    draft = load(args.draft_model)[0] if args.draft_model else None
    backend = select()
    backend.install(model)
    if draft is not None:
        backend.install(draft)
    vocab = int(model(mx.array([[0]])).shape[-1])
    print(f"model {path}, BLAS {BLAS}, K={args.k}, prompt {args.prompt_len} tokens")
    rows = []
    for bs in args.batch_size:
        row = measure(model, vocab, bs, args, draft)
        rows.append(row)
        per_token = row["verify_ms"] / (row["accepted"] + 1)
        print(
            f"batch {bs}: decode {row['decode_ms']:.1f} ms, verify {row['verify_ms']:.1f} ms "
            f"(median pair ratio {row['ratio']:.2f}), {row['accepted']:.2f} drafts kept "
            f"a row: {row['decode_ms'] / per_token:.2f}x the tokens per second of decode"
        )
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="model dir (default: --preset)")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    p.add_argument("--k", type=int, default=4, help="drafts per row and verify step")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--pairs", type=int, default=40, help="timed decode/verify pairs")
    p.add_argument("--draft-model", default=None, help="draft with this model in the worker")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
