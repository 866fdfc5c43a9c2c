"""The worker's side of --max-memory: the budget, what the process holds, what its steps
add (reported to the scheduler in `WorkerReady.memory`), and the last line of defence
around each step.

- `budget()`: --max-memory, or the device backend's default (`Backend.max_memory()`, asked
  before the model loads), split among the worker processes on this machine.
- `step_figures()`: the per-token and per-pair bytes of a step's temporaries, from the
  model's own shapes; `scheduler/memory_budget.py` does the arithmetic with them.
- `StepGuard`: before a step runs, what mlx holds now plus what the step will add must fit
  the budget, else the step is refused as out of memory (its requests get a 503, the
  worker goes on). It catches what the scheduler cannot see: buffers the worker keeps
  (a kept lookahead buffer), an estimate that fell short.
- `is_out_of_memory(exc)`: mlx's own allocation failures. On Metal mlx raises
  `[metal::malloc] ...`; the CPU backend of mlx 0.32 does not check `malloc` at all (a
  failed allocation is a segfault, and Linux overcommits anyway, so the OOM killer
  comes first): there, only admission and the guard keep the process alive, and the
  supervisor restarts a worker that died.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import resource

import mlx.core as mx

from common.messages import DecodeBatch, ExtendBatch, MemoryReport
from common.sizes import format_size
from scheduler.memory_budget import MemoryBudget

logger = logging.getLogger("worker")

OOM_MARKERS = ("[malloc]", "[metal::malloc]", "unable to allocate", "out of memory", "bad_alloc")
# Tests only: a cap on the worker's address space (bytes beyond what it maps once loaded),
# so allocations past it fail; and a budget reported to the scheduler in place of the real
# one, so admission lets through what the guard must then refuse.
TEST_ADDRESS_SPACE = "RADIX_MLX_TEST_WORKER_ADDRESS_SPACE"
TEST_REPORTED_BUDGET = "RADIX_MLX_TEST_REPORTED_BUDGET"


CACHE_MIN, CACHE_MAX = 16 << 20, 1 << 30  # mlx's buffer cache under --max-memory


class StepOutOfMemory(RuntimeError):
    """A step that would not fit (or did not): its requests fail, the worker goes on."""


def budget(max_memory: int | None, backend, processes: int) -> int:
    """This worker process's bytes: --max-memory (or the backend's default) divided by the
    worker processes on this machine (--dp-size replicas, ranks of a group)."""
    total = max_memory if max_memory is not None else backend.max_memory()
    return total // max(processes, 1)


def _dims(model) -> tuple[int, int, int]:
    """(attention heads, hidden size, MLP width per token) from the model's args (a
    multimodal model's `text_config`); a MoE counts its active experts' widths."""
    args = model.args if hasattr(model, "args") else object()
    fields = dict(vars(args)) if hasattr(args, "__dict__") else {}
    fields.update(fields.get("text_config") or {})

    def first(*names, default=0):  # a per-layer list counts its widest layer
        found = [fields[n] for n in names if fields.get(n)]
        if not found:
            return default
        value = found[0]
        return int(max(value) if isinstance(value, (list, tuple)) else value)

    hidden = first("hidden_size", "d_model", "dim", default=1024)
    heads = first("num_attention_heads", "n_heads", "n_head", default=hidden // 64)
    experts = first("num_experts_per_tok", "moe_topk", default=1)
    width = first("moe_intermediate_size", default=0) * experts
    width = max(width, first("intermediate_size", "ffn_hidden_size", default=4 * hidden))
    shared = first("shared_expert_intermediate_size", default=0)
    return heads, hidden, width + shared


def step_figures(model, layout, state_layout, vocab: int, prefill_step: int) -> dict:
    """The MemoryReport fields that describe a step's temporaries (not budget, fixed):
    scores in float32 plus a byte of mask per (query, key) pair and window; K/V gathered
    decoded in the model's dtype; ~6 hidden-wide and 4 MLP-wide float32 vectors per token
    (measured on the CPU: docs/performance.md); logits and the sampler's copies per row."""
    heads, hidden, width = _dims(model)
    windows = len({w for w in layout.windows if w is not None})
    decoded = dataclasses.replace(layout, kv_cache_dtype="auto")
    state = state_layout.bytes_per_slot if state_layout is not None else 0
    return dict(
        kv_token_bytes=decoded.bytes_per_slot,
        score_bytes=4 * heads + 1 + windows,
        act_token_bytes=4 * (6 * hidden + 4 * width),
        row_bytes=4 * 4 * vocab + 2 * state,
        prefill_step=prefill_step,
    )


def pool_bytes(total: int, figures: dict, fraction: float, count_process: bool = False) -> int:
    """What an auto-sized pool may take: the budget less what is held now (the weights,
    the process) and one prefill pass's temporaries, times the fraction."""
    process = process_bytes() if count_process else 0
    report = MemoryReport(budget=total, fixed=mx.get_active_memory() + process, **figures)
    step = figures["prefill_step"]
    reserve = MemoryBudget(report).extend_bytes([(step, step)])
    left = total - report.fixed - reserve
    if left <= 0:
        _refuse(
            f"--max-memory ({format_size(total)}) leaves nothing for a KV pool beside the "
            f"weights and process ({format_size(report.fixed)}) and a prefill step "
            f"({format_size(reserve)})"
        )
    return int(left * fraction)


def _refuse(reason: str):
    logger.error("cannot serve: %s", reason)
    raise SystemExit(2)


def process_bytes() -> int:
    """The process's resident memory beside mlx's arrays (the interpreter, the libraries,
    the tokenizer): resident set less mlx's active memory (Linux; 0 where /proc has none)."""
    try:
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
    return max(resident - mx.get_active_memory(), 0)


def report(total: int, figures: dict, count_process: bool = False) -> MemoryReport:
    """The report, `fixed` measured now that the weights and pools are allocated: what mlx
    holds, the rest of the process (`count_process`: on the CPU, where it shares the
    budget's memory), and mlx's buffer cache, held at a quarter of what is left
    (at most CACHE_MAX): its freed buffers stay in the process beside a step's new ones."""
    process = process_bytes() if count_process else 0
    held = mx.get_active_memory() + process
    cache = min(CACHE_MAX, max((total - held) // 4, CACHE_MIN))
    fixed = held + cache
    out = MemoryReport(total, fixed, **figures, cache=cache, process=process)
    logger.info(
        "memory: budget %s (--max-memory), held %s (weights and pools %s, process %s, "
        "buffer cache %s), %s for steps",
        format_size(total), format_size(fixed), format_size(fixed - cache - process),
        format_size(process), format_size(cache), format_size(total - fixed),
    )  # fmt: skip
    if out.fixed >= out.budget:
        _refuse(
            f"the weights, pools and process ({format_size(out.fixed)}) do not fit "
            f"--max-memory ({format_size(out.budget)}): lower --max-total-tokens or raise "
            "--max-memory"
        )
    return out


def for_scheduler(memory: MemoryReport) -> MemoryReport:
    """The report the scheduler gets: the real one, but for tests (TEST_REPORTED_BUDGET)."""
    reported = os.environ.get(TEST_REPORTED_BUDGET)
    return dataclasses.replace(memory, budget=int(reported)) if reported else memory


class StepGuard:
    """Refuses a step whose predicted peak, on top of what mlx holds now, exceeds the
    budget (see the module docstring)."""

    def __init__(self, memory: MemoryReport):
        # the cache may hold freed buffers beside what is active (the process is not in
        # mlx's count of active memory)
        self.budget = memory.budget - memory.cache - memory.process
        self.total = memory.budget
        self.math = MemoryBudget(dataclasses.replace(memory, fixed=0))

    def check(self, runner, msg: ExtendBatch | DecodeBatch) -> None:
        if isinstance(msg, ExtendBatch):
            rows = [(len(r.prefix_slot_ids), len(r.input_ids)) for r in msg.reqs]
            need = self.math.extend_bytes(rows)
        else:
            lens = [
                len(runner.ledger.slots(rid)) + 1 for rid in msg.rids if rid in runner.decodings
            ]
            held = runner.buffer.nbytes() if runner.buffer is not None else 0
            need = max(self.math.decode_bytes(lens) - held, 0)
        active = mx.get_active_memory()
        if active + need > self.budget and runner.lookahead.bet is not None:
            runner.lookahead.invalidate()  # a kept buffer, which the scheduler does not count
            active = mx.get_active_memory()
        if active + need > self.budget:
            raise StepOutOfMemory(
                f"out of memory computing this step: it needs {format_size(need)} beside "
                f"the {format_size(active)} mlx holds, over the {format_size(self.budget)} "
                f"that --max-memory ({format_size(self.total)}) leaves mlx"
            )


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocation failure (mlx's, or Python's MemoryError)."""
    if isinstance(exc, (MemoryError, StepOutOfMemory)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in OOM_MARKERS)


def apply_test_limits(memory: MemoryReport) -> None:
    """Tests only (TEST_ADDRESS_SPACE = slack bytes): cap the address space at what is
    mapped now plus what the budget leaves the steps and the cache, plus the slack, so
    that allocations beyond --max-memory fail."""
    slack = os.environ.get(TEST_ADDRESS_SPACE)
    if not slack:
        return
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = vm + memory.budget - memory.fixed + memory.cache + int(slack)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    logger.warning(
        "test address-space cap: %s (%s mapped now)", format_size(limit), format_size(vm)
    )
