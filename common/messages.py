"""Every message that crosses a process boundary, defined once.

Three links (see docs/architecture.md):
  client SDK <-> router      Client* messages on the router's ZMQ front door
  router <-> scheduler       GenerateReq / AbortReq down, TokenOutBatch / ReqError up
  scheduler <-> worker       ExtendBatch / DecodeBatch / ReleaseBatch down, StepResult up
  router <-> remote replica  the router <-> scheduler messages, ReplicaPing / ReplicaStatus
Each receiver decodes with its own registry below, so a message sent to the wrong socket
is rejected as unknown rather than misread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# ---------------------------------------------------------------- sampling

GRAMMAR_KINDS = ("", "json_schema", "regex", "lark", "ebnf")


@dataclass
class SamplingParams:
    """Per-request sampling; `temperature == 0` means greedy."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # 0 is off too, as in mlx-lm (its default) and vLLM
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # token id (a decimal string, as in OpenAI's JSON) -> added to its logit, in [-100, 100]
    logit_bias: dict[str, float] = field(default_factory=dict)
    # Constrained decoding (common/grammar_spec.py): the kind of `grammar` ("" for none,
    # or one of GRAMMAR_KINDS) and its source text; the worker masks every step with it.
    grammar_kind: str = ""
    grammar: str = ""
    # The prompt's own logprobs (echo + logprobs): every prompt token's after the first,
    # with `top_logprobs` alternatives each.
    prompt_logprobs: bool = False

    def __post_init__(self):
        if isinstance(self.logit_bias, dict):  # the SDK's int keys as the wire's strings
            self.logit_bias = {str(k): v for k, v in self.logit_bias.items()}

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidParam naming the first parameter out of range."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):  # fmt: skip
            value = getattr(self, name)
            if not _finite(value):  # NaN compares false with every bound: say what it is
                raise InvalidParam(name, f"must be a finite number, not {value}")
        checks = [
            (self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1"),
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "must be >= 1, or 0 or -1 for off"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (0 <= self.top_logprobs <= 20, "top_logprobs", "must be in [0, 20]"),
            (self.seed is None or 0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise InvalidParam(name, rule)
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise InvalidParam("stop_token_ids", f"must be in [0, {vocab_size})")
        self.bias_by_token(vocab_size)
        if self.grammar_kind not in GRAMMAR_KINDS or bool(self.grammar_kind) != bool(self.grammar):
            raise InvalidParam("grammar_kind", f"must be one of {GRAMMAR_KINDS[1:]} with a grammar")

    def bias_by_token(self, vocab_size: int | None = None) -> dict[int, float]:
        """`logit_bias` with int token ids; InvalidParam naming the first bad entry."""
        if not isinstance(self.logit_bias, dict):
            raise InvalidParam("logit_bias", "must map token ids to biases")
        out = {}
        for key, bias in self.logit_bias.items():
            if not key.isdecimal() or (vocab_size is not None and int(key) >= vocab_size):
                vocab = f"[0, {vocab_size})" if vocab_size is not None else "the vocabulary"
                raise InvalidParam("logit_bias", f"keys must be token ids in {vocab}, got {key!r}")
            if type(bias) not in (int, float) or not (_finite(bias) and -100 <= bias <= 100):
                raise InvalidParam("logit_bias", f"values must be in [-100, 100], got {bias!r}")
            out[int(key)] = float(bias)
        return out

    @property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty != 1
            or self.frequency_penalty != 0
            or self.presence_penalty != 0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _finite(x: float) -> bool:
    return math.isfinite(x)


class InvalidParam(ValueError):
    """A sampling parameter out of range: `field` (SamplingParams' name, which an API may
    call otherwise: OpenAI's max_tokens is max_new_tokens) and the rule it breaks."""

    def __init__(self, field: str, rule: str):
        super().__init__(f"{field} {rule}")
        self.field, self.rule = field, rule


# ---------------------------------------------------------------- router <-> scheduler


@dataclass
class GenerateReq:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams


@dataclass
class AbortReq:
    rid: str


@dataclass
class TokenOut:
    """New tokens of one request since its previous TokenOut."""

    rid: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Per token in `token_ids` when the request asked for logprobs: the sampled token's
    # logprob, and the top alternatives as [[token_id, logprob], ...].
    logprobs: list[float] | None = None
    top_logprobs: list[list[Any]] | None = None
    queue_time: float = 0.0  # seconds from arrival to the first prefill, on the first output
    # On the first output of a request that asked for them: per prompt token after the
    # first, [logprob, [[token_id, logprob], ...]].
    prompt_logprobs: list[Any] | None = None


@dataclass
class TokenOutBatch:
    outputs: list[TokenOut]


@dataclass
class ReqError:
    """A request the scheduler refused or lost; `status` is the HTTP status to report."""

    rid: str
    message: str
    code: str = "invalid_request_error"
    status: int = 400
    retry_after: float = 0.0  # seconds for the HTTP Retry-After header (0: none)


@dataclass
class SchedulerReady:
    num_slots: int
    max_running_requests: int
    context_len: int
    model_type: str


@dataclass
class SchedulerStats:
    """Gauges and cumulative counters for the router's /metrics, sent whenever they change
    (at most once per scheduling step) and every 0.5 s."""

    num_running: int
    num_queued: int
    token_usage: float
    capacity: int
    evicted_tokens: int
    retracted_requests: int
    # a distributed worker's last timed decode-step collectives and how many were timed
    collective_seconds: float = 0.0
    collective_probes: int = 0


@dataclass
class CacheEvicted:
    """What the scheduler's prefix cache dropped since its last CacheEvicted, so the
    router's guess of it (router/approx_tree.py) drops it too. Each path is the tokens from
    the root down to the first token of an evicted subtree: the cache no longer holds any
    sequence that starts with the whole path, and still holds `path[:-1]`. Paths a queued
    or running request will cache again are left out."""

    paths: list[list[int]]


@dataclass
class WorkerHung:
    """The worker has not answered step `step` for `seconds` (over --watchdog-timeout):
    the router kills and restarts it."""

    step: int
    seconds: float


# ---------------------------------------------------------------- scheduler <-> worker


@dataclass
class ReleaseReq:
    """A request leaving the worker: flush its deferred KV to the pool, or drop it.
    `snapshot` (models with recurrent layers, flush only): a state slot to copy the
    request's final recurrent state into, the state after all the tokens it has KV for."""

    rid: str
    flush: bool
    snapshot: int = 0


@dataclass
class ExtendReq:
    rid: str
    input_ids: list[int]
    prefix_slot_ids: list[int]
    out_cache_loc: list[int]
    sampling: SamplingParams
    last_chunk: bool = True
    # Only when the request uses sampling penalties: the tokens behind prefix_slot_ids, and
    # the outputs already generated (a retracted request resuming).
    context_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    # Models with recurrent layers (WorkerReady.num_state_slots > 0), in state slots
    # 1..num_state_slots (0: none / the zero state). `state_slot`: the request's own
    # working state, the same in every chunk. `prefix_state`: the slot holding the state
    # after exactly the prefix_slot_ids tokens (a trie snapshot, or `state_slot` itself
    # for a chunk continuation; 0 only with no prefix). `snapshots`: [n, slot] pairs,
    # copy the state after the first n of input_ids into slot (1 <= n <= len(input_ids)).
    state_slot: int = 0
    prefix_state: int = 0
    snapshots: list[list[int]] = field(default_factory=list)


@dataclass
class ExtendBatch:
    step: int
    reqs: list[ExtendReq]
    release: list[ReleaseReq] = field(default_factory=list)


@dataclass
class DecodeBatch:
    step: int
    rids: list[str]
    out_cache_loc: list[int]
    release: list[ReleaseReq] = field(default_factory=list)
    # The scheduler expects to decode the same requests next: the worker may compute that
    # step while the scheduler handles this one (it is dropped if the next message differs).
    lookahead: bool = False
    # Speculative decoding: per row, draft tokens to verify after its last token and the
    # fresh slots for their KV (one each); [] when no row drafts. The reply's `accepted`
    # says how many of each row's drafts were kept. With a draft model in the worker
    # (--speculative-algorithm draft) a drafting row sends only its slots and empty
    # drafts: the worker proposes one token per slot and replies with them (`drafts`).
    drafts: list[list[int]] = field(default_factory=list)
    draft_cache_loc: list[list[int]] = field(default_factory=list)


@dataclass
class ReleaseBatch:
    step: int
    release: list[ReleaseReq]


@dataclass
class StepResult:
    """Sampled tokens of a step, one per sampled request, in descriptor order."""

    step: int
    rids: list[str]
    next_token_ids: list[int]
    # Present when any row asked for logprobs; rows that did not hold 0.0 and [].
    logprobs: list[float] | None = None
    top_logprobs: list[list[Any]] | None = None
    # Present when a sampled row asked for its prompt's logprobs: per row, None or as
    # TokenOut.prompt_logprobs.
    prompt_logprobs: list[Any] | None = None
    # A decode step with drafts: per row, how many of its drafts were accepted; the row's
    # new tokens are those drafts followed by its next_token_ids entry.
    accepted: list[int] | None = None
    # A distributed worker: seconds a recent decode step's collectives took, replayed
    # alone (worker_mlx.distributed.CollectiveProbe); 0.0 when none was timed since.
    collective_seconds: float = 0.0
    # With a draft model in the worker, per row: the drafts it proposed for a row with
    # draft slots, else its guess of the token this step produced (one; the row's shadow
    # proposal).
    drafts: list[list[int]] | None = None
    # A decode step the worker computed on receipt: its seconds, from the descriptor to
    # the tokens on the host (None for an extend, or a step computed ahead). The
    # scheduler weighs a verify step's cost against a plain one's with it.
    step_seconds: float | None = None


@dataclass
class MemoryReport:
    """What the worker's memory holds and what its steps add (worker_mlx/memory.py), for
    the scheduler's admission (scheduler/memory_budget.py). Bytes, except `prefill_step`."""

    budget: int  # --max-memory (or the backend's default) for this worker process
    fixed: int  # held for the process's life: weights, KV pool, state pool (measured)
    kv_token_bytes: int  # one token's K/V over all layers as attention reads it (decoded)
    score_bytes: int  # per (query, key) pair of one layer: its scores and mask
    act_token_bytes: int  # per prefill token: hidden states and MLP activations
    row_bytes: int  # per sampled row: logits and the sampler's temporaries
    prefill_step: int  # tokens per forward pass and row (--prefill-step-size)
    cache: int = 0  # of `fixed`: freed buffers mlx's cache may keep for reuse
    process: int = 0  # of `fixed`: the process before the model (interpreter, libraries)


@dataclass
class WorkerReady:
    num_slots: int
    model_type: str
    num_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str
    context_len: int
    vocab_size: int
    eos_token_ids: list[int]
    blas: str
    # state slots for recurrent layers (1..num_state_slots; 0: the model has none)
    num_state_slots: int = 0
    # whether decode steps may carry drafts (no sliding windows, no recurrent layers)
    verifies_drafts: bool = False
    # None: admission counts KV slots only (a scripted worker, an older worker)
    memory: MemoryReport | None = None


@dataclass
class WorkerError:
    step: int
    message: str
    # the step ran out of memory (or would have): its requests get a 503, the worker goes on
    out_of_memory: bool = False


# ---------------------------------------------------------------- router <-> remote replica
# The link carries the router <-> scheduler messages as they are, one frame each, and its
# own (ReplicaPing up; ReplicaStatus, ReplicaFrameError down) as two frames, REPLICA_CONTROL
# and the message, so a router passes the scheduler's frames on without decoding them twice.

REPLICA_CONTROL = b"radix-mlx-replica"


@dataclass
class ModelIdentity:
    """What a replica serves (common/model_identity.py): a router refuses other models."""

    model_type: str
    vocab_size: int
    digest: str  # SHA-256 (hex) of config.json and the tokenizer files


@dataclass
class ReplicaPing:
    """router -> replica, every 0.5 s from connecting: the replica answers each with a
    ReplicaStatus and forgets (aborting its requests) a router it has not heard from."""

    router: str  # who is asking, for the replica's log


@dataclass
class ReplicaStatus:
    """replica -> router: the answer to every ping and news of every change of state.
    `instance` is new at each start of the replica process; `ready` is its scheduler's
    report, None until it is serving."""

    identity: ModelIdentity
    instance: str
    state: str  # "starting", "ready", "restarting", "draining" (no new requests) or "stopped"
    reason: str = ""
    ready: SchedulerReady | None = None


@dataclass
class ReplicaFrameError:
    """replica -> router: a frame the replica could not use and that named no request."""

    message: str


# ---------------------------------------------------------------- SDK <-> router


@dataclass
class ClientGenerate:
    rid: str
    sampling: SamplingParams
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    stream: bool = False
    api_key: str | None = None  # required when the server runs with --api-key


@dataclass
class ClientAbort:
    rid: str


@dataclass
class Output:
    """What a generation produced: an increment of it (a chunk) or all of it, with
    `finish_reason` set on the last and usage counted so far. The one output record of
    the router (HTTP and the SDK front door) and, as ClientResult, of the SDK link;
    `router.output.OutputAccumulator` merges chunks into wholes.

    `logprobs` and `top_logprobs` are per output token, 1:1 with `token_ids`: the sampled
    token's logprob, and its best alternatives as [[token_id, logprob], ...]. Both are
    None when the request did not ask for them, or when they cannot be aligned with the
    token ids (a chunk with tokens came without them)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[float] | None = None
    top_logprobs: list[list[Any]] | None = None
    prompt_logprobs: list[Any] | None = None  # as TokenOut's, on the first chunk


@dataclass(kw_only=True)
class ClientResult(Output):
    """An Output of the SDK request `rid`: a streamed increment, or the whole answer when
    the request does not stream."""

    rid: str


@dataclass
class ClientError:
    rid: str
    message: str
    code: str = "invalid_request_error"
    status: int = 400


def _registry(*classes: type) -> dict[str, type]:
    return {c.__name__: c for c in classes}


SCHEDULER_FROM_ROUTER = _registry(GenerateReq, AbortReq)
SCHEDULER_FROM_WORKER = _registry(WorkerReady, StepResult, WorkerError)
ROUTER_INBOX = _registry(
    TokenOutBatch, ReqError, SchedulerReady, SchedulerStats, CacheEvicted, WorkerHung
)
WORKER_INBOX = _registry(ExtendBatch, DecodeBatch, ReleaseBatch)
FRONTDOOR_INBOX = _registry(ClientGenerate, ClientAbort)
CLIENT_INBOX = _registry(ClientResult, ClientError)
REPLICA_INBOX = _registry(GenerateReq, AbortReq, ReplicaPing)
REPLICA_CONTROL_INBOX = _registry(ReplicaStatus, ReplicaFrameError)
