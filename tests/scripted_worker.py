"""A scripted stand-in for the worker and the router around the REAL scheduler process.

`SchedulerHarness` spawns `scheduler.process.run_scheduler` and plays both of its peers on
real ZMQ sockets in the test process:

- the worker side (`ScriptedWorker`) keeps a shadow KV pool in which each slot holds an
  identity of the token sequence up to and including its token, checks every descriptor
  against the slot contract of docs/architecture.md, and samples with a deterministic
  function of the sequence so far (`ScriptedModel`), so the expected output of every
  request is known regardless of batching, chunking or retraction;
- the router side sends `GenerateReq` / `AbortReq`, collects `TokenOutBatch`, `ReqError`
  and `SchedulerStats`, and `verify()` compares every request with its expectation.

Violations are recorded rather than raised on the spot (the model keeps going so one bug
does not hide the next) and reported together by `verify()`.
"""

from __future__ import annotations

import multiprocessing
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import zmq

from common.ipc import Endpoints, bind_pull, connect_push
from common.messages import (
    ROUTER_INBOX,
    WORKER_INBOX,
    AbortReq,
    DecodeBatch,
    ExtendBatch,
    ExtendReq,
    GenerateReq,
    HoldAhead,
    ReleaseBatch,
    ReleaseReq,
    ReqError,
    SamplingParams,
    SchedulerReady,
    SchedulerStats,
    StepResult,
    TokenOutBatch,
    WorkerReady,
)
from common.protocol import decode, encode
from common.server_args import ServerArgs
from tests.scripted_states import ShadowStates

ROOT_KEY = 0x5EED
VOCAB = 1000  # the tests' vocabulary; tokens 0 and 1 are the scripted model's eos


def toks(rng: random.Random, n: int) -> list[int]:
    """n random non-eos tokens."""
    return [rng.randrange(2, VOCAB) for _ in range(n)]


def chain(key: int, token: int) -> int:
    """Identity of a sequence extended by one token (deterministic: int tuples hash stably)."""
    return hash((key, token))


class Seq:
    """A token sequence with the identity of every prefix: keys[i] names tokens[: i + 1]."""

    __slots__ = ("tokens", "keys")

    def __init__(self, tokens: Iterable[int] = ()):
        self.tokens: list[int] = []
        self.keys: list[int] = []
        for t in tokens:
            self.append(t)

    def append(self, token: int) -> None:
        self.keys.append(chain(self.keys[-1] if self.keys else ROOT_KEY, token))
        self.tokens.append(token)


@dataclass
class ReqSpec:
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    eos_at: int | None = None  # output index at which the scripted model emits eos
    expect_error: str | None = None  # ReqError code the scheduler must answer with
    period: int | None = None  # the model repeats the last `period` tokens (n-gram drafts hold)


class ScriptedModel:
    """Next token = f(identity of the whole sequence); eos only where a spec asks for it."""

    def __init__(self, vocab_size: int, eos_token_ids: list[int]):
        self.vocab_size = vocab_size
        self.eos = list(eos_token_ids)
        self.normal = [t for t in range(vocab_size) if t not in set(eos_token_ids)]
        self.specs: dict[str, ReqSpec] = {}

    def next_token(self, rid: str, seq: Seq) -> int:
        spec = self.specs[rid]
        return self._next(seq, len(spec.prompt), spec.eos_at, spec.period)

    def _next(self, seq: Seq, prompt_len: int, eos_at: int | None, period: int | None = None):
        if eos_at is not None and len(seq.tokens) - prompt_len == eos_at:
            return self.eos[0]
        if period is not None and len(seq.tokens) >= period:
            return seq.tokens[-period]
        return self.normal[seq.keys[-1] % len(self.normal)]

    def preview(self, prompt: list[int], n: int, eos_at: int | None = None) -> list[int]:
        """The first `n` tokens the model would emit after `prompt` (ignoring stop rules)."""
        seq, out = Seq(prompt), []
        for _ in range(n):
            out.append(self._next(seq, len(prompt), eos_at))
            seq.append(out[-1])
        return out

    def expected(self, rid: str) -> tuple[list[int], str]:
        """The whole output and finish reason, applying the scheduler's stop rules."""
        spec = self.specs[rid]
        sp = spec.sampling
        seq = Seq(spec.prompt)
        out: list[int] = []
        while True:
            tok = self.next_token(rid, seq)
            seq.append(tok)
            out.append(tok)
            if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos):
                return out, "stop"
            if len(out) >= sp.max_new_tokens:
                return out, "length"


@dataclass
class Live:
    """A request the worker holds slots for: since its first extend until its release."""

    slots: list[int]
    decoding: bool = False
    pending: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, key, position)


class ScriptedWorker:
    """Shadow KV pool + slot-contract checks; answers extends and decodes like the worker."""

    def __init__(
        self,
        num_slots: int,
        model: ScriptedModel,
        *,
        max_extend_tokens: int | None = None,
        max_running: int | None = None,
        num_state_slots: int = 0,
    ):
        self.n = num_slots
        self.model = model
        self.max_extend_tokens = max_extend_tokens
        self.max_running = max_running
        # content[slot] = (identity of the sequence up to the token, writer rid, position)
        self.content: list[tuple[int, str, int] | None] = [None] * (num_slots + 1)
        self.seqs: dict[str, Seq] = {}  # every request's known sequence: prompt + sampled
        self.live: dict[str, Live] = {}
        self.held = [0] * (num_slots + 1)  # live requests referencing each slot
        self.pending_slots: dict[int, str] = {}  # slot -> rid with a deferred write to it
        self.first_prefix: dict[str, int] = {}  # prefix length of each request's first extend
        self.extends: dict[str, list[ExtendReq]] = {}  # every ExtendReq seen, per request
        self.violations: list[str] = []
        self.last_step = 0
        self.counts = {
            "extend": 0,
            "decode": 0,
            "release_batch": 0,
            "flush": 0,
            "drop": 0,
            "hold_ahead": 0,
        }
        self.max_decode_batch = 0
        self.states = ShadowStates(num_state_slots, self._bad)
        # the machine a test models: (rows, columns per row) -> a decode step's seconds,
        # reported as the worker reports its steps' (None: not reported)
        self.step_seconds: Callable[[int, int], float] | None = None

    def register(self, rid: str, prompt: list[int]) -> None:
        self.seqs[rid] = Seq(prompt)

    def _bad(self, message: str) -> None:
        self.violations.append(message)

    # ------------------------------------------------------------ messages

    def handle(self, msg: ExtendBatch | DecodeBatch | ReleaseBatch) -> StepResult | None:
        if isinstance(msg, HoldAhead):  # names the step in flight: no step of its own
            if msg.step != self.last_step:
                self._bad(f"HoldAhead for step {msg.step}, in flight: {self.last_step}")
            self.counts["hold_ahead"] += 1
            return None
        if msg.step <= self.last_step:
            self._bad(f"step {msg.step} after step {self.last_step}: steps must increase")
        self.last_step = max(self.last_step, msg.step)
        self._release(msg.release, msg.step)  # the worker applies releases before anything
        if isinstance(msg, ReleaseBatch):
            self.counts["release_batch"] += 1
            return None
        if isinstance(msg, ExtendBatch):
            self.counts["extend"] += 1
            return self._extend(msg)
        self.counts["decode"] += 1
        return self._decode(msg)

    def _release(self, release: list[ReleaseReq], step: int) -> None:
        seen = set()
        for r in release:
            if r.rid in seen:
                self._bad(f"step {step}: {r.rid} released twice in one message")
            seen.add(r.rid)
            live = self.live.pop(r.rid, None)
            if live is None:
                self._bad(f"step {step}: release of {r.rid}, which holds no slots on the worker")
                continue
            for slot, key, pos in live.pending:
                self.pending_slots.pop(slot, None)
                if r.flush:
                    self.content[slot] = (key, r.rid, pos)
            keys = self.seqs[r.rid].keys
            self.states.release(r, keys[len(live.slots) - 1] if live.slots else None)
            self.counts["flush" if r.flush else "drop"] += 1
            for s in live.slots:
                if 1 <= s <= self.n:
                    self.held[s] -= 1

    def _commit_all(self) -> None:
        """What the worker does at the start of every extend: flush all buffered decode KV."""
        for rid, live in self.live.items():
            for slot, key, pos in live.pending:
                self.content[slot] = (key, rid, pos)
            live.pending.clear()
        self.pending_slots.clear()

    def _check_fresh(self, slots: list[int], seen: set[int], where: str) -> None:
        for s in slots:
            if not 1 <= s <= self.n:
                self._bad(f"{where}: fresh slot {s} outside 1..{self.n}")
                continue
            if s in seen:
                self._bad(f"{where}: slot {s} handed out twice in one step")
            seen.add(s)
            if s in self.pending_slots:
                self._bad(
                    f"{where}: slot {s} reused while a deferred flush is pending "
                    f"(decode KV of {self.pending_slots[s]})"
                )
            elif self.held[s] > 0:
                owners = sorted(rid for rid, lv in self.live.items() if s in lv.slots)
                self._bad(f"{where}: fresh slot {s} is still held by live request(s) {owners}")

    def _describe(self, slot: int) -> str:
        c = self.content[slot]
        return "nothing (never written)" if c is None else f"{c[1]}'s token at position {c[2]}"

    def _extend(self, msg: ExtendBatch) -> StepResult:
        self._commit_all()
        step = msg.step
        if not msg.reqs:
            self._bad(f"step {step}: ExtendBatch with no requests")
        new_tokens = sum(len(r.input_ids) for r in msg.reqs)
        if self.max_extend_tokens is not None and new_tokens > self.max_extend_tokens:
            self._bad(
                f"step {step}: extend of {new_tokens} new tokens exceeds the chunked prefill "
                f"size {self.max_extend_tokens}"
            )
        self.states.extend(step, msg.reqs, {rid: seq.keys for rid, seq in self.seqs.items()})
        fresh: set[int] = set()
        in_batch: set[str] = set()
        rids: list[str] = []
        toks: list[int] = []
        for r in msg.reqs:
            where = f"step {step} extend {r.rid}"
            seq = self.seqs.get(r.rid)
            if seq is None:
                self._bad(f"{where}: unknown request")
                continue
            if r.rid in in_batch:
                self._bad(f"{where}: request appears twice in one batch")
            in_batch.add(r.rid)
            self.extends.setdefault(r.rid, []).append(r)
            live = self.live.get(r.rid)
            p = len(r.prefix_slot_ids)
            if live is not None:
                if live.decoding:
                    self._bad(f"{where}: extend for a request that is already decoding")
                if r.prefix_slot_ids != live.slots:
                    self._bad(f"{where}: chunk continuation's prefix is not the request's slots")
            else:
                self.first_prefix.setdefault(r.rid, p)
            end = p + len(r.input_ids)
            if not r.input_ids:
                self._bad(f"{where}: no input tokens (at least one token must be computed)")
            if len(r.out_cache_loc) != len(r.input_ids):
                self._bad(f"{where}: {len(r.input_ids)} input ids but {len(r.out_cache_loc)} slots")
            if r.input_ids != seq.tokens[p:end]:
                self._bad(f"{where}: input_ids are not the request's tokens at [{p}, {end})")
            if r.last_chunk and end != len(seq.tokens):
                self._bad(f"{where}: last chunk ends at {end}, the sequence has {len(seq.tokens)}")
            if not r.last_chunk and end >= len(seq.tokens):
                self._bad(f"{where}: not the last chunk yet it covers the whole sequence")
            if r.last_chunk and getattr(r.sampling, "penalized", False):
                # sampling penalties need the whole history: the prefix's tokens and outputs
                n_prompt = len(self.model.specs[r.rid].prompt)
                context, outputs = getattr(r, "context_ids", None), getattr(r, "output_ids", None)
                if context is not None and context != seq.tokens[:p]:
                    self._bad(f"{where}: context_ids are not the tokens behind the prefix")
                if outputs is not None and outputs != seq.tokens[n_prompt:]:
                    self._bad(f"{where}: output_ids are not the outputs generated so far")
            for i, s in enumerate(r.prefix_slot_ids):
                c = self.content[s] if 1 <= s <= self.n else None
                if i >= len(seq.keys) or c is None or c[0] != seq.keys[i]:
                    self._bad(
                        f"{where}: prefix slot {s} (position {i}) holds {self._describe(s)}"
                        if 1 <= s <= self.n
                        else f"{where}: prefix slot {s} outside 1..{self.n}"
                    )
                    break  # one report per request is enough
            self._check_fresh(r.out_cache_loc, fresh, where)
            for j, s in enumerate(r.out_cache_loc):  # extend writes before the step ends
                pos = p + j
                if 1 <= s <= self.n and pos < len(seq.keys):
                    self.content[s] = (seq.keys[pos], r.rid, pos)
            if live is None:
                live = self.live[r.rid] = Live(list(r.prefix_slot_ids))
                self._hold(r.prefix_slot_ids)
            live.slots.extend(r.out_cache_loc)
            self._hold(r.out_cache_loc)
            if r.last_chunk:
                live.decoding = True
                tok = self.model.next_token(r.rid, seq)
                seq.append(tok)
                rids.append(r.rid)
                toks.append(tok)
        return StepResult(step, rids, toks)

    def _hold(self, slots: list[int]) -> None:
        for s in slots:
            if 1 <= s <= self.n:
                self.held[s] += 1

    def _decode(self, msg: DecodeBatch) -> StepResult:
        step = msg.step
        where = f"step {step} decode"
        if not msg.rids:
            self._bad(f"{where}: DecodeBatch with no requests")
        if len(msg.out_cache_loc) != len(msg.rids):
            self._bad(f"{where}: {len(msg.rids)} requests but {len(msg.out_cache_loc)} slots")
        if len(set(msg.rids)) != len(msg.rids):
            self._bad(f"{where}: a request appears twice")
        if self.max_running is not None and len(msg.rids) > self.max_running:
            self._bad(f"{where}: {len(msg.rids)} running requests > {self.max_running}")
        self.max_decode_batch = max(self.max_decode_batch, len(msg.rids))
        fresh: set[int] = set()
        self._check_fresh(msg.out_cache_loc, fresh, where)
        drafts = msg.drafts or [[] for _ in msg.rids]
        if len(drafts) != len(msg.rids) or [len(d) for d in drafts] != [
            len(locs) for locs in (msg.draft_slots or [[] for _ in msg.rids])
        ]:
            self._bad(f"{where}: drafts and their slots do not match the rows")
            drafts = [[] for _ in msg.rids]
        draft_locs = msg.draft_slots or [[] for _ in msg.rids]
        for locs in draft_locs:
            self._check_fresh(locs, fresh, where)
        toks: list[int] = []
        accepted: list[int] = []
        for rid, s, draft, locs in zip(msg.rids, msg.out_cache_loc, drafts, draft_locs):
            live = self.live.get(rid)
            seq = self.seqs.get(rid)
            if live is None or seq is None or not live.decoding:
                self._bad(f"{where}: {rid} is not a live decoding request")
                toks.append(self.model.normal[0])
                continue
            pos = len(live.slots)
            if pos != len(seq.tokens) - 1:
                self._bad(
                    f"{where}: {rid} gets a slot for position {pos} but its last sampled token "
                    f"is at {len(seq.tokens) - 1}"
                )
            if 1 <= s <= self.n and pos < len(seq.keys):
                live.pending.append((s, seq.keys[pos], pos))  # deferred: not in the pool yet
                self.pending_slots[s] = rid
                self.states.decode(rid, seq.keys[pos])
            live.slots.append(s)
            self._hold([s])
            tok = self.model.next_token(rid, seq)
            seq.append(tok)
            a = 0
            while a < len(draft) and draft[a] == tok:  # the draft's KV is this token's
                pos, s = pos + 1, locs[a]
                live.pending.append((s, seq.keys[pos], pos))
                self.pending_slots[s] = rid
                live.slots.append(s)
                self._hold([s])
                tok = self.model.next_token(rid, seq)
                seq.append(tok)
                a += 1
            toks.append(tok)
            accepted.append(a)
        columns = 1 + max((len(d) for d in drafts), default=0)
        took = self.step_seconds(len(msg.rids), columns) if self.step_seconds else None
        return StepResult(
            step, list(msg.rids), toks, accepted=accepted if msg.drafts else None,
            step_seconds=took,
        )  # fmt: skip


# ---------------------------------------------------------------- the harness


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    prompt_tokens: int = -1
    completion_tokens: int = -1
    cached_tokens: int = -1
    error: ReqError | None = None


class SchedulerDied(AssertionError):
    pass


Hook = Callable[[ExtendBatch | DecodeBatch | ReleaseBatch], bool]


class SchedulerHarness:
    """The real scheduler process between a scripted worker and a stand-in router."""

    def __init__(
        self,
        args: ServerArgs,
        num_slots: int,
        *,
        vocab_size: int = 1000,
        eos_token_ids: tuple[int, ...] = (0, 1),
        context_len: int = 4096,
        num_state_slots: int = 0,
    ):
        self.args = args
        self.num_slots = num_slots
        self.num_state_slots = num_state_slots
        self.context_len = context_len
        self.model = ScriptedModel(vocab_size, list(eos_token_ids))
        self.worker = ScriptedWorker(
            num_slots,
            self.model,
            max_extend_tokens=args.chunked_prefill_size,
            max_running=args.max_running_requests,
            num_state_slots=num_state_slots,
        )
        self.specs: dict[str, ReqSpec] = {}
        self.aborted: set[str] = set()
        self.results: dict[str, Result] = {}
        self.other_errors: dict[str, ReqError] = {}  # ReqErrors for rids never submitted
        self.stats: list[tuple[SchedulerStats, int]] = []  # with #requests done by then
        self.ready: SchedulerReady | None = None
        self.router_violations: list[str] = []
        self.hooks: list[Hook] = []
        self.timers: list[tuple[float, Callable[[], None]]] = []
        self.proc = None
        self.ctx: zmq.Context | None = None
        # ipc paths must stay short (sun_path is ~107 bytes), so not pytest's tmp_path
        self.runtime_dir = tempfile.mkdtemp(prefix="rsched-")

    # ------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 20.0) -> SchedulerHarness:
        from scheduler.process import run_scheduler

        ep = Endpoints.ipc(self.runtime_dir)
        self.ctx = zmq.Context()
        self.worker_in = bind_pull(self.ctx, ep.worker_in)
        self.router_in = bind_pull(self.ctx, ep.router_in)
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_scheduler, args=(self.args, ep), name="scheduler", daemon=True
        )
        self.proc.start()
        self.to_scheduler = connect_push(self.ctx, ep.scheduler_from_worker)
        self.to_scheduler_router = connect_push(self.ctx, ep.scheduler_in)
        self.poller = zmq.Poller()
        self.poller.register(self.worker_in, zmq.POLLIN)
        self.poller.register(self.router_in, zmq.POLLIN)
        self.to_scheduler.send(
            encode(
                WorkerReady(
                    num_slots=self.num_slots,
                    model_type="scripted",
                    num_layers=1,
                    n_kv_heads=1,
                    head_dim=1,
                    dtype="float16",
                    context_len=self.context_len,
                    vocab_size=self.model.vocab_size,
                    eos_token_ids=self.model.eos,
                    blas="none",
                    num_state_slots=self.num_state_slots,
                    verifies_drafts=True,
                )
            )
        )
        self.run_until(lambda: self.ready is not None, timeout, "SchedulerReady")
        assert self.ready.num_slots == self.num_slots, self.ready
        return self

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
            self.proc = None
        if self.ctx is not None:
            self.ctx.destroy(linger=0)
            self.ctx = None
        shutil.rmtree(self.runtime_dir, ignore_errors=True)

    # ------------------------------------------------------------ router side

    def submit(
        self,
        rid: str,
        prompt: list[int],
        max_new_tokens: int,
        *,
        eos_at: int | None = None,
        ignore_eos: bool = False,
        stop_token_ids: Iterable[int] = (),
        expect_error: str | None = None,
        period: int | None = None,
        **sampling_kw: Any,
    ) -> ReqSpec:
        """Send a GenerateReq; the scripted model ignores temperature and penalties."""
        sampling = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=0.0,
            ignore_eos=ignore_eos,
            stop_token_ids=list(stop_token_ids),
            **sampling_kw,
        )
        spec = ReqSpec(rid, list(prompt), sampling, eos_at, expect_error, period)
        assert rid not in self.specs, f"test bug: {rid} submitted twice"
        self.specs[rid] = spec
        self.model.specs[rid] = spec
        self.worker.register(rid, spec.prompt)
        self.results[rid] = Result()
        self.to_scheduler_router.send(encode(GenerateReq(rid, spec.prompt, sampling)))
        return spec

    def abort(self, rid: str) -> None:
        self.aborted.add(rid)
        self.to_scheduler_router.send(encode(AbortReq(rid)))

    def send_raw(self, frame: bytes) -> None:
        self.to_scheduler_router.send(frame)

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        self.timers.append((time.monotonic() + delay, fn))

    def on_worker(self, hook: Hook) -> None:
        """Call `hook(msg)` for each worker message after the shadow handled it and before
        the reply goes out (so e.g. an abort sent there arrives mid-step); True removes it."""
        self.hooks.append(hook)

    def done(self, rid: str) -> bool:
        r = self.results[rid]
        return r.finish is not None or r.error is not None

    def all_done(self) -> bool:
        return all(self.done(rid) for rid in self.specs)

    def n_done(self) -> int:
        return sum(self.done(rid) for rid in self.specs)

    # ------------------------------------------------------------ the loop

    def pump(self, timeout_ms: int = 20) -> None:
        now = time.monotonic()
        due = [t for t in self.timers if t[0] <= now]
        if due:
            self.timers = [t for t in self.timers if t[0] > now]
            for _, fn in sorted(due, key=lambda t: t[0]):
                fn()
        events = dict(self.poller.poll(timeout_ms))
        if self.router_in in events:
            while True:
                try:
                    frame = self.router_in.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._on_router(decode(frame, ROUTER_INBOX))
        if self.worker_in in events:
            while True:
                try:
                    frame = self.worker_in.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = decode(frame, WORKER_INBOX)
                reply = self.worker.handle(msg)
                self.hooks = [h for h in self.hooks if not h(msg)]
                if reply is not None:
                    self.to_scheduler.send(encode(reply))
        if not self.proc.is_alive():
            raise SchedulerDied(
                f"the scheduler process died with exit code {self.proc.exitcode} "
                "(with debug_invariants an invariant failure kills it; see captured stderr)"
                + self._violation_text()
            )

    def run_until(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                pending = [rid for rid in self.specs if not self.done(rid)]
                raise AssertionError(
                    f"timed out after {timeout:.1f}s waiting for {what}; unfinished requests: "
                    f"{pending[:10]}; live on the worker: {sorted(self.worker.live)[:10]}"
                    + self._violation_text()
                )
            self.pump()

    def wait_done(self, timeout: float = 10.0) -> None:
        self.run_until(self.all_done, timeout, "every request to finish")

    def wait_idle(self, timeout: float = 5.0) -> SchedulerStats:
        """The first SchedulerStats sent after every request ended; it must show an idle,
        empty scheduler. Also waits for the worker to have received every release."""
        self.wait_done(timeout)
        total = len(self.specs)
        self.run_until(
            lambda: any(n == total for _, n in self.stats) and not self.worker.live,
            timeout,
            "idle SchedulerStats and every release on the worker",
        )
        after = [s for s, n in self.stats if n == total]
        first = after[0]
        assert first.num_running == 0 and first.num_queued == 0 and first.token_usage == 0, (
            f"scheduler not idle after every request ended: {first}"
        )
        return first

    def _on_router(self, msg) -> None:
        if isinstance(msg, TokenOutBatch):
            for o in msg.outputs:
                r = self.results.get(o.rid)
                if r is None:
                    self.router_violations.append(f"TokenOut for unknown request {o.rid}")
                    continue
                if r.finish is not None or r.error is not None:
                    self.router_violations.append(f"TokenOut for {o.rid} after it ended")
                r.tokens.extend(o.token_ids)
                spec = self.specs[o.rid]
                if o.prompt_tokens != len(spec.prompt) or o.completion_tokens != len(r.tokens):
                    self.router_violations.append(
                        f"{o.rid}: usage prompt {o.prompt_tokens} / completion "
                        f"{o.completion_tokens}, expected {len(spec.prompt)} / {len(r.tokens)}"
                    )
                if o.finish_reason is not None:
                    r.finish = o.finish_reason
                    r.prompt_tokens = o.prompt_tokens
                    r.completion_tokens = o.completion_tokens
                    r.cached_tokens = o.cached_tokens
        elif isinstance(msg, ReqError):
            r = self.results.get(msg.rid)
            if r is None:
                self.other_errors[msg.rid] = msg
            else:
                if r.finish is not None or r.error is not None:
                    self.router_violations.append(f"ReqError for {msg.rid} after it ended")
                r.error = msg
        elif isinstance(msg, SchedulerStats):
            self.stats.append((msg, self.n_done()))
        elif isinstance(msg, SchedulerReady):
            self.ready = msg

    # ------------------------------------------------------------ verdict

    def final_stats(self) -> SchedulerStats:
        assert self.stats, "no SchedulerStats received"
        return self.stats[-1][0]

    def _violation_text(self) -> str:
        v = self.worker.violations + self.router_violations
        if not v:
            return ""
        shown = "\n  ".join(v[:25])
        more = f"\n  ... and {len(v) - 25} more" if len(v) > 25 else ""
        return f"\nslot contract / protocol violations ({len(v)}):\n  {shown}{more}"

    def verify(self) -> None:
        """Every request ended as expected and no descriptor broke the slot contract."""
        problems = list(self.worker.violations) + list(self.router_violations)
        for rid, spec in self.specs.items():
            r = self.results[rid]
            if spec.expect_error is not None:
                if r.error is None or r.error.code != spec.expect_error:
                    problems.append(f"{rid}: expected ReqError {spec.expect_error}, got {r}")
                elif r.tokens or rid in self.worker.extends:
                    problems.append(f"{rid}: refused, yet it produced tokens or reached the worker")
                continue
            if r.error is not None:
                problems.append(f"{rid}: unexpected ReqError {r.error}")
                continue
            if r.finish is None:
                problems.append(f"{rid}: never finished")
                continue
            want, want_finish = self.model.expected(rid)
            if rid in self.aborted and r.finish == "abort":
                if r.tokens != want[: len(r.tokens)] or len(r.tokens) >= len(want):
                    problems.append(
                        f"{rid}: aborted output {r.tokens} is not a proper prefix of {want}"
                    )
            elif r.tokens != want or r.finish != want_finish:
                problems.append(
                    f"{rid}: got {r.tokens} ({r.finish}), expected {want} ({want_finish})"
                )
            if r.prompt_tokens != len(spec.prompt) or r.completion_tokens != len(r.tokens):
                problems.append(
                    f"{rid}: final usage prompt {r.prompt_tokens} completion "
                    f"{r.completion_tokens}, expected {len(spec.prompt)} / {len(r.tokens)}"
                )
            cached = self.worker.first_prefix.get(rid, 0)
            if r.cached_tokens != cached or not 0 <= cached < len(spec.prompt):
                problems.append(
                    f"{rid}: cached_tokens {r.cached_tokens}, but its first extend had a prefix "
                    f"of {cached} of {len(spec.prompt)} prompt tokens"
                )
        if problems:
            shown = "\n  ".join(problems[:30])
            more = f"\n  ... and {len(problems) - 30} more" if len(problems) > 30 else ""
            raise AssertionError(f"{len(problems)} problem(s):\n  {shown}{more}")
