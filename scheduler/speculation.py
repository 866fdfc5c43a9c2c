"""N-gram speculation (prompt lookup): draft tokens copied from a request's own history.

The drafts are proposed here, in the scheduler, rather than in the worker: the scheduler
has every request's tokens (prompt and output) and must know each row's draft count
before the step anyway, to allocate one KV slot per draft, so proposing here costs no
message and keeps the worker's step a pure function of its descriptor.

A request's last n tokens (n from `MAX_NGRAM` down to `MIN_NGRAM`, as the prompt-lookup
proposers of vLLM and SGLang) are looked up where they occurred before, most recent
first; the tokens that followed there are the draft. An index from each n-gram to the
position after its latest occurrence makes that O(1) a step. A match that runs into the
end of the history continues periodically (a loop of period p repeats), so a row that
loops drafts its full K.

Adaptive: a row drafts only while its drafts pay. It starts in shadow: each step its
proposal is computed (a dict lookup) but not sent, and compared with the token the
model then produced; SHADOW_HITS hits in a row switch drafting on. A drafting row whose
drafts keep failing (below LOW_ACCEPTANCE of its draft tokens kept over WINDOW steps)
goes back to shadow. So text that does not repeat itself never pays for a verify step,
and a row whose output starts to loop drafts from the next steps on. A step's drafts go
out only when the tokens they are expected to add (each row's running acceptance times
its draft count) pay for the verify step on this machine (`scheduler/step_cost.py`): a
few looping rows do not turn every row of a large batch into a verify row for nothing.
Rows with penalties, logit bias, logprobs or a grammar never draft: their next token
depends on state the drafts would have to replay.

`Speculator` is the scheduler's side of either proposer: the drafts of the decode step
in flight and their KV slots, from their allocation to what each row keeps of them.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

from common.image_keys import run_ids
from common.messages import StepResult, WorkerReady
from common.server_args import ServerArgs
from scheduler.cache import KVCacheManager
from scheduler.request import Req
from scheduler.step_cost import StepCost

logger = logging.getLogger("scheduler")

MIN_NGRAM = 2
MAX_NGRAM = 4
WINDOW = 4  # drafting steps over which a row's acceptance is judged
LOW_ACCEPTANCE = 0.3  # share of draft tokens kept below which a row goes back to shadow
SHADOW_HITS = 2  # first-token hits in a row that switch a shadow row to drafting
RATE_WEIGHT = 0.25  # of a step's acceptance in a row's running mean


@dataclass
class NgramIndex:
    """Position after the latest occurrence of each n-gram of a token history; the
    n-gram ending at the last token is indexed only once a later token follows it."""

    tokens: list[int] = field(default_factory=list)
    after: dict[tuple[int, ...], int] = field(default_factory=dict)

    def extend(self, new: list[int]) -> None:
        for tok in new:
            self.tokens.append(tok)
            end = len(self.tokens) - 1  # n-grams ending before this token now have a next
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end >= n:
                    self.after[tuple(self.tokens[end - n : end])] = end

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the longest recent n-gram equal to the end."""
        toks = self.tokens
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if len(toks) <= n:
                continue
            at = self.after.get(tuple(toks[-n:]))
            if at is not None:
                draft: list[int] = []
                for i in range(k):  # past the end, the match's own continuation repeats
                    j = at + i
                    draft.append(toks[j] if j < len(toks) else draft[j - len(toks)])
                return draft
        return []


@dataclass
class Adaptive:
    """Whether a row's drafts pay: in shadow (its proposal is compared with the token
    the model produced, not sent) until SHADOW_HITS hits in a row, then drafting until
    it keeps under LOW_ACCEPTANCE of its draft tokens over WINDOW steps."""

    drafting: bool = False
    shadow: int | None = None  # the first token a shadow row would have drafted
    hits: int = 0  # shadow hits in a row
    drafted: int = 0  # draft tokens sent in the current window
    kept: int = 0
    steps: int = 0  # drafting steps in the current window
    rate: float = 1.0  # running mean of the share of its drafts kept (what a draft is worth)

    def observe(self, drafted: int, kept: int, first: int) -> None:
        """After a step: `drafted` tokens sent, `kept` of them accepted, `first` the
        first token the step produced."""
        if not self.drafting:
            self.hits = self.hits + 1 if first == self.shadow else 0
            self.drafting = self.hits >= SHADOW_HITS
            return
        if drafted:
            self.rate += RATE_WEIGHT * (kept / drafted - self.rate)
        self.drafted += drafted
        self.kept += kept
        self.steps += 1
        if self.steps < WINDOW:
            return
        if self.kept < LOW_ACCEPTANCE * self.drafted:
            self.drafting, self.hits = False, 0
        self.drafted = self.kept = self.steps = 0


@dataclass
class DraftState(Adaptive):
    """One request's n-gram speculation: its history index, and whether its drafts pay."""

    index: NgramIndex = field(default_factory=NgramIndex)
    seen: int = 0  # tokens of the request's fill indexed so far
    pads: set[int] | None = None  # its images' pad values (a vision prompt's), found once


class NgramSpeculation:
    """Drafts for a decode step's rows, and what the worker kept of them."""

    worker_drafts = False  # the drafts are the tokens proposed here

    def __init__(self, num_draft_tokens: int):
        self.k = num_draft_tokens
        self.rows: dict[str, DraftState] = {}

    @staticmethod
    def eligible(req: Req) -> bool:
        p = req.sampling
        return not (p.penalized or p.logit_bias or p.logprobs or p.grammar_kind)

    def drafts(self, reqs: list[Req], context_len: int) -> list[list[int]]:
        """Per request, its drafts for the next step ([] for none): at most K, and never
        past max_new_tokens or the context length (the step's own token counts)."""
        return [self._draft(req, context_len) for req in reqs]

    def _draft(self, req: Req, context_len: int) -> list[int]:
        if not self.eligible(req):
            return []
        state = self.rows.get(req.rid)
        if state is None:
            state = self.rows[req.rid] = DraftState()
        fill = req.fill_ids
        state.index.extend(fill[state.seen :])
        state.seen = len(fill)
        room = min(req.remaining_new_tokens - 1, context_len - len(fill) - 1)
        draft = state.index.propose(min(self.k, room)) if room > 0 else []
        if req.images:  # an image's pad values are prompt tokens, never a draft
            if state.pads is None:
                state.pads = run_ids(req.input_ids, req.images)
            draft = list(itertools.takewhile(lambda t: t not in state.pads, draft))
        if state.drafting:
            return draft
        state.shadow = draft[0] if draft else None
        return []

    def observe(
        self, req: Req, drafted: int, kept: int, first: int, guess: int | None = None
    ) -> None:
        state = self.rows.get(req.rid)
        if state is not None:
            state.observe(drafted, kept, first)

    def active(self, reqs: list[Req]) -> bool:
        """Whether any of `reqs` may draft at its next step."""
        return any((state := self.rows.get(r.rid)) is not None and state.drafting for r in reqs)

    def forget(self, rid: str) -> None:
        self.rows.pop(rid, None)


class DraftModelSpeculation:
    """--speculative-algorithm draft: the worker's draft model proposes the tokens, so
    here a row only gets K fresh slots (fewer near its end), which is all the scheduler
    must decide before the step; the reply brings the drafts and how many were kept, and
    the rest (accepted slots kept, rejected ones freed, finishing inside a run) is the
    n-gram path's. Adaptive as n-gram rows are: the draft computes every row's tokens
    anyway, and for a row without draft slots the reply carries the draft's guess of the
    token the step produced: its shadow proposal."""

    worker_drafts = True

    def __init__(self, num_draft_tokens: int):
        self.k = num_draft_tokens
        self.rows: dict[str, Adaptive] = {}

    def drafts(self, reqs: list[Req], context_len: int) -> list[list[int]]:
        """Per request, placeholders for the drafts it asks the worker for ([]: none)."""
        out = []
        for req in reqs:
            row = self.rows.setdefault(req.rid, Adaptive())
            room = min(req.remaining_new_tokens - 1, context_len - len(req.fill_ids) - 1)
            n = min(self.k, room) if NgramSpeculation.eligible(req) and row.drafting else 0
            out.append([0] * max(n, 0))
        return out

    def observe(
        self, req: Req, drafted: int, kept: int, first: int, guess: int | None = None
    ) -> None:
        """As NgramSpeculation's; `guess` is the draft's guess the reply carries."""
        row = self.rows.get(req.rid)
        if row is None:
            return
        if not drafted:
            row.shadow = guess
        row.observe(drafted, kept, first)

    def active(self, reqs: list[Req]) -> bool:
        """Whether any of `reqs` may draft at its next step."""
        return any((row := self.rows.get(r.rid)) is not None and row.drafting for r in reqs)

    def forget(self, rid: str) -> None:
        self.rows.pop(rid, None)


class Speculator:
    """The proposer --speculative-algorithm names (None: decoding without drafts) and the
    drafts of the decode step in flight: their slots, allocated before the step, and when
    its result comes back, the tokens each row keeps (the slots of the others freed)."""

    def __init__(
        self,
        args: ServerArgs,
        worker: WorkerReady,
        kv: KVCacheManager,
        context_len: int,
        eos_ids: frozenset[int],
    ):
        self.proposer = _proposer(args, worker)
        self.kv, self.context_len, self.eos_ids = kv, context_len, eos_ids
        self.drafts: list[list[int]] = []  # per row of the step in flight ([] for none)
        self.slots: list[list[int]] = []  # their slots
        self.cost = StepCost()

    @property
    def enabled(self) -> bool:
        return self.proposer is not None

    @property
    def worker_drafts(self) -> bool:
        """Whether the step in flight asks the worker's draft model for its drafts."""
        return bool(self.slots) and self.proposer.worker_drafts

    def draft(self, running: list[Req]) -> tuple[list[list[int]], list[list[int]]]:
        """This step's drafts and their slots ([] and [] for none), when the budget
        holds them after the running requests' own slots and they pay for the verify
        step (`StepCost`); asking the worker for them, the drafts are empty."""
        self.drafts, self.slots = [], []
        if self.proposer is None:
            return [], []
        drafts = self.proposer.drafts(running, self.context_len)
        n = sum(len(d) for d in drafts)
        if not n or self.kv.budget() < n:
            return [], []
        if not self._pays(running, drafts):
            return [], []
        it = iter(self.kv.alloc(n))
        self.drafts = drafts
        self.slots = [[next(it) for _ in d] for d in drafts]
        if self.proposer.worker_drafts:  # slots alone: the worker's draft model fills them
            return [[] for _ in drafts], self.slots
        return self.drafts, self.slots

    def _pays(self, running: list[Req], drafts: list[list[int]]) -> bool:
        """Whether the step's drafts pay for its verify step (`StepCost`). Always, when a
        drafting row samples with a seed: its tokens depend on which of its steps verify
        drafts, so its drafting follows its own tokens alone, or its seed would not
        reproduce its output."""
        drafting = [(r, d) for r, d in zip(running, drafts) if d]
        if any(r.sampling.seed is not None and not r.sampling.greedy for r, _ in drafting):
            return True
        rows = self.proposer.rows
        expected = len(running) + sum(rows[r.rid].rate * len(d) for r, d in drafting)
        return self.cost.pays(len(running), 1 + max(len(d) for _, d in drafting), expected)

    def active(self, reqs: list[Req]) -> bool:
        """Whether any of `reqs` may draft at its next step."""
        return self.proposer is not None and self.proposer.active(reqs)

    def take_drafted(self, req: Req, result: StepResult, row: int) -> bool:
        """For a row that drafted (False for one that did not): its accepted drafts and
        the worker's next token, up to where it finishes (a stop token, eos or
        max_new_tokens inside the run ends it there, as without speculation). The slots
        of the drafts it keeps (all but the last new token's) become its KV, the others
        are freed."""
        if not (self.drafts and self.drafts[row]):
            return False
        accepted = result.accepted[row] if result.accepted else 0
        n = 0
        for tok in self._proposed(result, row)[:accepted] + [result.next_token_ids[row]]:
            req.output_ids.append(tok)
            n += 1
            req.check_finished(self.eos_ids)
            if req.finish_reason is not None:
                break
        slots = self.slots[row]
        self.kv.keep_draft_slots(req, slots[: n - 1], slots[n - 1 :])
        return True

    def _proposed(self, result: StepResult, row: int) -> list[int]:
        """The drafts a row verified: those sent, or the worker's draft model's (none if a
        reply lacks them: then every draft slot is freed)."""
        if not self.proposer.worker_drafts:
            return self.drafts[row]
        return result.proposed[row] if result.proposed is not None else []

    def observe(self, req: Req, result: StepResult, row: int, first: int) -> None:
        """Tell the proposer what a row's step did; `first` is the first token it made."""
        if self.proposer is None:
            return
        drafted = len(self.drafts[row]) if self.drafts else 0
        kept = result.accepted[row] if drafted and result.accepted else 0
        guess = result.guesses[row] if result.guesses is not None else None
        self.proposer.observe(req, drafted, kept, first, guess)

    def end_step(self, result: StepResult | None = None) -> None:
        """The step in flight is over: its `result`, or None when it failed (then its
        draft slots are freed; after a result, every drafting row kept or freed its own)."""
        if result is None:
            self.kv.allocator.free([s for row in self.slots for s in row])
        elif self.proposer is not None:
            columns = 1 + max((len(d) for d in self.drafts), default=0)
            self.cost.record(len(result.rids), columns, result.step_seconds)
        self.drafts, self.slots = [], []

    def forget(self, rid: str) -> None:
        if self.proposer is not None:
            self.proposer.forget(rid)


def _proposer(
    args: ServerArgs, worker: WorkerReady
) -> NgramSpeculation | DraftModelSpeculation | None:
    kinds = {"ngram": NgramSpeculation, "draft": DraftModelSpeculation}
    kind = kinds.get(args.speculative_algorithm)
    if kind is None:
        return None
    if not worker.verifies_drafts:
        logger.warning("this model cannot verify drafts: decoding without speculation")
        return None
    return kind(args.speculative_num_draft_tokens)
