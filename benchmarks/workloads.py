"""Workloads for `benchmarks.serving`: prompt sets and the load generator that sends them.

mlx_lm.server only takes text, radix-mlx takes token ids. To send both the same prompts,
prompts are built from "word" tokens (a leading space and letters) whose text re-encodes
to exactly the same ids, and every prompt's round trip is checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import re
import sys
import time
from typing import Any

from benchmarks.agent_sessions import WORKLOAD as AGENT_SESSIONS
from benchmarks.agent_sessions import agent_session_sessions, params_from_args
from benchmarks.records import INPROCESS, Prompt, RequestResult, Session, SuiteLoad, WorkloadSpec

WORKLOADS = (
    "random", "generated-shared-prefix", "multi-tenant", "multi-turn", "repeat", "agent",
    "code-edit", AGENT_SESSIONS,
)  # fmt: skip
_WORD = re.compile(r" [A-Za-z]+")


class PromptFactory:
    """Random prompts over round-trip-safe word tokens, with the tokenizer's BOS if any."""

    def __init__(self, tokenizer, seed: int | str = 0):
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        self.specials = list(tokenizer.encode(""))
        self.words = safe_word_tokens(tokenizer)
        if len(self.words) < 8:
            raise RuntimeError(f"only {len(self.words)} round-trip-safe word tokens in vocab")

    def words_of(self, n: int) -> list[int]:
        """`n` random word tokens (no BOS): a piece that can follow anything."""
        return [self.rng.choice(self.words) for _ in range(n)]

    def prompt(self, n: int, prefix: Prompt | None = None) -> Prompt:
        """A prompt of exactly `n` tokens (BOS included), optionally after `prefix`."""
        head = prefix.ids if prefix is not None else self.specials
        body = self.words_of(max(1, n - len(head)))
        ids = head + body
        text = (prefix.text if prefix is not None else "") + self.tokenizer.decode(body)
        check_round_trip(self.tokenizer, ids, text)
        return Prompt(ids, text)

    def piece(self, n: int) -> Prompt:
        """`n` word tokens to append to a conversation (no BOS)."""
        ids = self.words_of(n)
        return Prompt(ids, self.tokenizer.decode(ids))

    def continued(
        self, history: Prompt, answer_ids: list[int], answer: str, user: Prompt, as_text: bool
    ) -> Prompt:
        """The next turn: history + the server's answer + a new user message.

        Token ids keep the answer's exact ids; `as_text` (always, for a text-only server)
        re-tokenizes the text instead, as the server itself will.
        """
        text = history.text + answer + user.text
        if as_text:
            return Prompt(list(self.tokenizer.encode(text)), text)
        return Prompt(history.ids + answer_ids + user.ids, text)


_SAFE_WORDS: dict[int, tuple[Any, list[int]]] = {}  # holds the tokenizer: ids stay unique


def safe_word_tokens(tokenizer) -> list[int]:
    """Ids whose text is ' word' and re-encodes to that one id (scanned once per tokenizer)."""
    if id(tokenizer) not in _SAFE_WORDS:
        out = []
        for i in range(len(tokenizer)):
            text = tokenizer.decode([i])
            if _WORD.fullmatch(text) and tokenizer.encode(text, add_special_tokens=False) == [i]:
                out.append(i)
        _SAFE_WORDS[id(tokenizer)] = (tokenizer, out)
    return _SAFE_WORDS[id(tokenizer)][1]


def check_round_trip(tokenizer, ids: list[int], text: str) -> None:
    """Refuse a prompt a text-only server would tokenize differently."""
    got = list(tokenizer.encode(text))
    if got != ids:
        raise RuntimeError(f"prompt does not re-tokenize to its ids ({len(got)} vs {len(ids)})")


def _lens(rng: random.Random, full: int, ratio: float, n: int) -> list[int]:
    """SGLang's range ratio: lengths uniform in [full * ratio, full]."""
    low = max(1, int(full * ratio))
    return [rng.randint(low, max(low, full)) for _ in range(n)]


def random_sessions(
    f: PromptFactory, num_prompts: int, input_len: int, output_len: int, range_ratio: float
) -> list[Session]:
    """Independent prompts of random words; no prefix is shared."""
    ins = _lens(f.rng, input_len, range_ratio, num_prompts)
    outs = _lens(f.rng, output_len, range_ratio, num_prompts)
    return [Session([f.prompt(i)], [o], ["request"]) for i, o in zip(ins, outs)]


def shared_prefix_sessions(
    f: PromptFactory,
    groups: int,
    prompts_per_group: int,
    system_len: int,
    question_len: int,
    output_len: int,
) -> list[Session]:
    """G groups x P prompts: a shared system prefix then a unique question, shuffled."""
    sessions = []
    for _ in range(groups):
        system = f.prompt(system_len)
        for _ in range(prompts_per_group):
            p = f.prompt(len(system.ids) + question_len, prefix=system)
            sessions.append(Session([p], [output_len], ["request"]))
    f.rng.shuffle(sessions)
    return sessions


def multi_tenant_sessions(
    f: PromptFactory, tenants: int, requests_per_tenant: int, system_len: int,
    question_len: int, output_len: int,
) -> list[Session]:  # fmt: skip
    """T tenants, each with its own long system prefix, R requests each, arriving
    interleaved: round k sends every tenant's k-th request, in a fresh random order each
    round (so no fixed rotation lines tenants up with replicas by accident)."""
    systems = [f.prompt(system_len) for _ in range(tenants)]
    out = []
    for _ in range(requests_per_tenant):
        order = list(range(tenants))
        f.rng.shuffle(order)
        for t in order:
            p = f.prompt(len(systems[t].ids) + question_len, prefix=systems[t])
            out.append(Session([p], [output_len], [f"tenant{t}"]))
    return out


def multi_turn_sessions(
    f: PromptFactory,
    conversations: int,
    turns: int,
    user_len: int,
    output_len: int,
    history: str = "ids",
) -> list[Session]:
    """C conversations of T turns; turn k > 1 carries the whole history (built at run time)."""
    sessions = []
    labels = [f"turn{t + 1}" for t in range(turns)]
    for _ in range(conversations):
        first = f.prompt(user_len + len(f.specials))
        rest = [f.piece(user_len) for _ in range(turns - 1)]
        outs = [output_len] * turns
        sessions.append(Session([first, *rest], outs, labels, True, history == "text"))
    return sessions


def repeat_sessions(f: PromptFactory, length: int, output_len: int, warm_runs: int):
    """One long prompt sent cold, then `warm_runs` more times: the cache's best case."""
    n = warm_runs + 1
    return [Session([f.prompt(length)] * n, [output_len] * n, ["cold"] + ["warm"] * warm_runs)]


def agent_sessions(
    f: PromptFactory, sessions: int, turns: int, system_len: int, task_len: int,
    result_len: int, output_len: int,
) -> list[Session]:  # fmt: skip
    """S agents of T turns each, the way coding agents talk to a server: one system prompt
    with the tool definitions shared by every session, a task, then turns that each carry
    the whole history forward (the model's answer, standing for its tool call) plus a tool
    result of `result_len` tokens. Everything before a turn's newest tool result was sent
    before, by this session or (the system prompt) another."""
    system = f.prompt(system_len)
    labels = [f"turn{t + 1}" for t in range(turns)]
    out = []
    for _ in range(sessions):
        task = f.prompt(len(system.ids) + task_len, prefix=system)
        results = [f.piece(result_len) for _ in range(turns - 1)]
        out.append(Session([task, *results], [output_len] * turns, labels, True))
    return out


def code_edit_sessions(
    f: PromptFactory, num_prompts: int, text_len: int, output_len: int
) -> list[Session]:
    """Prompts that hold a text and then ask for it back with a small change (the text,
    then an instruction and the text's first words changed), as an editing assistant is
    asked: a model that follows it copies its prompt, which n-gram speculation drafts. On
    random-weight models the output does not copy; what repeats there is a looping
    model's own output (`--loop`)."""
    out = []
    for _ in range(num_prompts):
        text = f.prompt(text_len)
        ask = f.piece(12)  # stands for "Return the text above with one word changed:"
        edit = f.piece(2)
        body = text.ids[len(f.specials) :]
        ids = text.ids + ask.ids + edit.ids + body[2:12]
        p = Prompt(ids, f.tokenizer.decode(ids))
        check_round_trip(f.tokenizer, p.ids, p.text)
        out.append(Session([p], [output_len], ["request"]))
    return out


BUILDERS = {
    "random": random_sessions,
    "generated-shared-prefix": shared_prefix_sessions,
    "multi-tenant": multi_tenant_sessions,
    "multi-turn": multi_turn_sessions,
    "repeat": repeat_sessions,
    "agent": agent_sessions,
    "code-edit": code_edit_sessions,
    AGENT_SESSIONS: agent_session_sessions,
}


def build_sessions(spec: WorkloadSpec, factory: PromptFactory) -> list[Session]:
    """The workload's sessions; its params are the builder's keyword arguments."""
    if spec.name not in BUILDERS:
        raise ValueError(f"unknown workload {spec.name!r}; expected one of {WORKLOADS}")
    return BUILDERS[spec.name](factory, **spec.params)


def spec_from_args(args) -> WorkloadSpec:
    """The workload chosen on the command line, with only its own parameters."""
    name = args.workload
    if name == "random":
        params = dict(
            num_prompts=args.num_prompts,
            input_len=args.random_input_len,
            output_len=args.random_output_len,
            range_ratio=args.random_range_ratio,
        )
    elif name == "generated-shared-prefix":
        params = dict(
            groups=args.gsp_num_groups,
            prompts_per_group=args.gsp_prompts_per_group,
            system_len=args.gsp_system_prompt_len,
            question_len=args.gsp_question_len,
            output_len=args.gsp_output_len,
        )
    elif name == "multi-tenant":
        params = dict(
            tenants=args.mtn_tenants,
            requests_per_tenant=args.mtn_requests_per_tenant,
            system_len=args.mtn_system_len,
            question_len=args.mtn_question_len,
            output_len=args.mtn_output_len,
        )
    elif name == "multi-turn":
        params = dict(
            conversations=args.mt_conversations,
            turns=args.mt_turns,
            user_len=args.mt_user_len,
            output_len=args.mt_output_len,
            history=args.mt_history,
        )
    elif name == "agent":
        params = dict(
            sessions=args.agent_sessions,
            turns=args.agent_turns,
            system_len=args.agent_system_len,
            task_len=args.agent_task_len,
            result_len=args.agent_result_len,
            output_len=args.agent_output_len,
        )
    elif name == AGENT_SESSIONS:
        params = params_from_args(args)
    elif name == "code-edit":
        params = dict(
            num_prompts=args.num_prompts,
            text_len=args.code_edit_text_len,
            output_len=args.code_edit_output_len,
        )
    else:
        params = dict(
            length=args.repeat_len,
            output_len=args.repeat_output_len,
            warm_runs=args.repeat_warm_runs,
        )
    return WorkloadSpec(name, params)


# issue 20's agent load: 8 sessions x 6 turns over a shared system prompt with tools
AGENT = dict(sessions=8, turns=6, system_len=1024, task_len=64, result_len=96, output_len=32)


def standard_suite() -> list[SuiteLoad]:
    """The issues' target loads (plus a random-load sweep for the throughput plot). "mlx-lm"
    stands for the peers: `--peers` (benchmarks.serving) says which run in its place."""
    both = ("radix-mlx", "mlx-lm")
    rnd = dict(input_len=256, output_len=64, range_ratio=1.0)
    gsp = dict(groups=4, prompts_per_group=8, system_len=1024, question_len=64, output_len=32)
    turns = dict(conversations=8, turns=4, user_len=64, output_len=32)
    return [
        SuiteLoad(WorkloadSpec("random", dict(num_prompts=32, **rnd)), [1, 4], both),
        SuiteLoad(WorkloadSpec("random", dict(num_prompts=64, **rnd)), [8], (*both, INPROCESS)),
        SuiteLoad(
            WorkloadSpec("generated-shared-prefix", gsp),
            [8],
            ("radix-mlx", "radix-mlx-no-cache", INPROCESS, "mlx-lm"),
        ),
        SuiteLoad(WorkloadSpec("multi-turn", turns), [8], both),
        SuiteLoad(WorkloadSpec("repeat", dict(length=2048, output_len=16, warm_runs=9)), [1], both),
        SuiteLoad(WorkloadSpec("agent", AGENT), [8], both),
    ]


def speculative_suite() -> list[SuiteLoad]:
    """Issue 21's speculation targets: n-gram speculation against radix-mlx without it,
    at batch 1 and 8. The code-edit load runs on the looping build, whose outputs repeat
    their context as an edited text would; random prompts on the plain build, whose
    outputs repeat nothing, so drafts fail and the off-switch is what is measured. At
    concurrency 8, 16 prompts arrive as two batches of 8 decoding together (batch 8), not
    staggered, where other requests' prefill would sit inside every TPOT."""
    both = ("radix-mlx", "radix-mlx-ngram")
    edit = dict(text_len=192, output_len=128)
    rnd = dict(input_len=192, output_len=128, range_ratio=1.0)
    return [
        SuiteLoad(WorkloadSpec("code-edit", dict(num_prompts=6, **edit)), [1], both, loop=True),
        SuiteLoad(WorkloadSpec("code-edit", dict(num_prompts=16, **edit)), [8], both, loop=True),
        SuiteLoad(WorkloadSpec("random", dict(num_prompts=6, **rnd)), [1], both),
        SuiteLoad(WorkloadSpec("random", dict(num_prompts=16, **rnd)), [8], both),
    ]


# --------------------------------------------------------------------------- load generator


class Clock:
    """Client-side timestamps of one request: TTFT and per-token gaps."""

    def __init__(self):
        self.start = time.perf_counter()
        self.last: float | None = None

    def tokens(self, res: RequestResult, n: int) -> None:
        """A chunk with `n` tokens arrived; its gap is spread over them, as SGLang does."""
        now = time.perf_counter()
        if self.last is None:
            res.ttft = now - self.start
        else:
            res.itls.extend([(now - self.last) / n] * n)
        self.last = now


class Progress:
    """tqdm when installed, else a line every 10%."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.done, self.desc, self.bar = total, 0, desc, None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, leave=False, file=sys.stderr)
            except ImportError:
                pass

    def update(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled and (self.done * 10 // self.total) > ((self.done - 1) * 10 // self.total):
            print(f"  {self.desc}: {self.done}/{self.total}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def send_one(sender, prompt: Prompt, out_len: int, res: RequestResult) -> None:
    """One request; any exception becomes a counted failure with its message."""
    clock = Clock()
    try:
        await sender.send(prompt, out_len, res, clock)
    except Exception as exc:  # every failure is reported, none stops the run
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    res.latency = time.perf_counter() - clock.start
    if res.output_len == 0 and res.streamed_tokens:
        res.output_len = res.streamed_tokens
    res.ok = not res.error and res.output_len > 0
    if not res.ok and not res.error:
        res.error = "no tokens received"


async def run_session(
    s: Session,
    sender,
    factory: PromptFactory,
    text_prompts: bool,
    sem: asyncio.Semaphore | None,
    progress: Progress,
) -> list[RequestResult]:
    """Turns of one session in order; a conversation carries its real answers forward
    (a conversation sender, benchmarks.conversations, carries them itself: it is sent
    each turn's new part alone)."""
    out: list[RequestResult] = []
    prompt = s.turns[0]
    conversation = sender.conversation() if hasattr(sender, "conversation") else None
    for k, (user, out_len, label) in enumerate(zip(s.turns, s.output_lens, s.labels)):
        if conversation is not None:
            prompt = user
        elif k and s.carry_history:
            prev = out[-1]
            as_text = text_prompts or s.history_as_text
            prompt = factory.continued(prompt, prev.output_ids, prev.output_text, user, as_text)
        elif k:
            prompt = user
        res = RequestResult(label, len(prompt.ids), out_len)
        if out and not out[-1].ok and s.carry_history:
            res.error = "an earlier turn of this conversation failed"
        else:
            async with sem or contextlib.nullcontext():
                await send_one(conversation or sender, prompt, out_len, res)
        out.append(res)
        progress.update()
    return out


async def run_sessions(
    sessions: list[Session],
    sender,
    factory: PromptFactory,
    text_prompts: bool,
    max_concurrency: int | None,
    request_rate: float,
    seed: int,
    progress: Progress,
) -> tuple[list[RequestResult], float]:
    """Start sessions at Poisson times (or all at once) under a concurrency cap."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    rng = random.Random(seed)
    start = time.perf_counter()
    tasks = []
    for s in sessions:
        tasks.append(
            asyncio.create_task(run_session(s, sender, factory, text_prompts, sem, progress))
        )
        if not math.isinf(request_rate):
            await asyncio.sleep(rng.expovariate(request_rate))
    done = await asyncio.gather(*tasks)
    return [r for session in done for r in session], time.perf_counter() - start
