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
and a row whose output starts to loop drafts from the next steps on. Rows with
penalties, logit bias, logprobs or a grammar never draft: their next token depends on
state the drafts would have to replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.request import Req

MIN_NGRAM = 2
MAX_NGRAM = 4
WINDOW = 4  # drafting steps over which a row's acceptance is judged
LOW_ACCEPTANCE = 0.3  # share of draft tokens kept below which a row goes back to shadow
SHADOW_HITS = 2  # first-token hits in a row that switch a shadow row to drafting


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

    def observe(self, drafted: int, kept: int, first: int) -> None:
        """After a step: `drafted` tokens sent, `kept` of them accepted, `first` the
        first token the step produced."""
        if not self.drafting:
            self.hits = self.hits + 1 if first == self.shadow else 0
            self.drafting = self.hits >= SHADOW_HITS
            return
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
        if state.drafting:
            return draft
        state.shadow = draft[0] if draft else None
        return []

    def observe(
        self, req: Req, drafted: int, kept: int, first: int, guess: list[int] | None = None
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
        self, req: Req, drafted: int, kept: int, first: int, guess: list[int] | None = None
    ) -> None:
        """As NgramSpeculation's; `guess` is what the reply says the draft proposed."""
        row = self.rows.get(req.rid)
        if row is None:
            return
        if not drafted:
            row.shadow = guess[0] if guess else None
        row.observe(drafted, kept, first)

    def active(self, reqs: list[Req]) -> bool:
        """Whether any of `reqs` may draft at its next step."""
        return any((row := self.rows.get(r.rid)) is not None and row.drafting for r in reqs)

    def forget(self, rid: str) -> None:
        self.rows.pop(rid, None)
