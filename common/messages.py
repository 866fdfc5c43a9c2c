"""Every message that crosses a process boundary, defined once.

Three links (see docs/architecture.md):
  client SDK <-> router      Client* messages on the router's ZMQ front door
  router <-> scheduler       GenerateReq / AbortReq / EmbedReq / LoraUpdate down,
                             TokenOutBatch / ReqError / EmbedOut / LoraUpdated up
  scheduler <-> worker       ExtendBatch / DecodeBatch / ReleaseBatch / EmbedBatch /
                             LoraUpdate down, StepResult / EmbedResult / LoraUpdated up
  router <-> remote replica  the router <-> scheduler messages, ReplicaPing / ReplicaStatus
Each receiver decodes with its own registry below, so a message sent to the wrong socket
is rejected as unknown rather than misread. The SDK link's messages (and SamplingParams)
are defined in `radix_mlx.messages`, the SDK's package, and re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# the SDK link's messages and the sampling parameters: radix_mlx owns them (see there)
from radix_mlx.messages import (  # noqa: F401
    CLIENT_INBOX,
    FRONTDOOR_INBOX,
    GRAMMAR_KINDS,
    ClientAbort,
    ClientError,
    ClientGenerate,
    ClientResult,
    InvalidParam,
    Output,
    SamplingParams,
    _registry,
)

# ---------------------------------------------------------------- router <-> scheduler


@dataclass
class ImagePart:
    """An image of a vision model's prompt (common/image_keys.py, worker_mlx/mrope.py): its
    placeholder run of `length` tokens starts at token `start` of the whole prompt, `grid`
    is its (t, h, w) grid (common/vision_layout.py), `key` is the SHA-256 digest of its
    bytes, the run's tokens in the input ids are `pad_values(key, vocab, length)`, and
    `pixels` are the processor's pixel values (float32), empty when the worker does not
    need them (the run is cached, or its vision embeddings are)."""

    start: int
    grid: list[int]
    length: int
    key: bytes
    pixels: bytes = b""


@dataclass
class GenerateReq:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    # Only requests with the same salt share cached prefixes (common/cache_salt.py).
    cache_salt: str = ""
    # The prompt's first tokens to keep cached ahead of others (Anthropic's cache_control
    # breakpoints: up to the end of the last marked block).
    priority_prefix_len: int = 0
    # The LoRA adapter it runs with: its id, the --lora flags' order from 1 (0: the base
    # model). Part of its cache namespace: prefixes are shared within one adapter only.
    lora: int = 0
    # A vision model's prompt images (ImagePart), in prompt order; their runs are pad values.
    images: list[ImagePart] = field(default_factory=list)


@dataclass
class AbortReq:
    rid: str


@dataclass
class EmbedReq:
    """An embeddings request: one row per input, pooled and answered together (EmbedOut).
    No KV is kept and the prefix cache is never touched."""

    rid: str
    inputs: list[list[int]]


@dataclass
class LoraUpdate:
    """router -> scheduler -> worker: load the LoRA adapter at `path` as id `lora`, or
    (`path` "") unload adapter `lora` (/admin/loras/*). The router never gives an id twice
    in a pair's life, so a prefix cached under an unloaded adapter's namespace serves no
    later one. The scheduler refuses requests of an unloading adapter at once, passes an
    unload on once that adapter's requests are done, and numbers it as a step (`step`)."""

    rid: str  # the router's id of this update, answered by LoraUpdated
    lora: int
    name: str
    path: str = ""
    step: int = -1

    def problem(self) -> str | None:
        """What makes it unusable, or None."""
        if self.lora < 1:
            return f"LoRA adapter id {self.lora}: ids start at 1 (0 is the base model)"
        if not self.name or ":" in self.name:
            return f"LoRA adapter name {self.name!r}: not empty, without ':'"
        return None


@dataclass
class LoraUpdated:
    """worker -> scheduler -> router: the LoraUpdate `rid` is done ("" error) or refused."""

    rid: str
    lora: int
    error: str = ""
    step: int = -1
    # bytes the worker's adapters hold now less before (its --max-memory admission counts it)
    held_delta: int = 0


@dataclass
class EmbedOut:
    """Each input's embedding as little-endian float32 bytes (pooled, normalized unless
    the model's sentence-transformers config says otherwise), in input order."""

    rid: str
    embeddings: list[bytes]
    prompt_tokens: int


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
    # Of `cached_tokens`, those the disk tier loaded (the rest came from the pool).
    disk_cached_tokens: int = 0


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
    # the worker's memory as it measured it (WorkerReady.memory; 0: not reported): its
    # budget, and what it holds for good (weights, pools), for a budget over several models
    memory_budget: int = 0
    memory_fixed: int = 0
    # the width of the worker's embeddings (the model's hidden size); 0: it cannot embed
    embedding_dim: int = 0
    embedding_normalized: bool = True  # they are L2-normalized (the model's config says)


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
    # a vision model's worker: its vision-tower runs and tower-cache hits so far
    vision_tower_runs: int = 0
    vision_cache_hits: int = 0


@dataclass
class CacheEvicted:
    """What the scheduler's prefix cache dropped since its last CacheEvicted, so the
    router's guess of it (router/replicas/approx_tree.py) drops it too. Each path is the tokens from
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
    # Its LoRA adapter's id (GenerateReq.lora; 0: none), the same in every chunk.
    lora: int = 0
    # Vision models: every image of the prompt (prefix included: the positions after an
    # image depend on it), in prompt order.
    images: list[ImagePart] = field(default_factory=list)


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
    # Speculative decoding, per row ([] when no row drafts): `draft_slots`, fresh slots
    # for the KV of its drafts, one each, and `drafts`, the draft tokens to verify after
    # its last token (the scheduler's n-gram proposals, as many as slots). The reply's
    # `accepted` says how many of each row's drafts were kept.
    drafts: list[list[int]] = field(default_factory=list)
    draft_slots: list[list[int]] = field(default_factory=list)
    # The worker's draft model proposes the drafts (--speculative-algorithm draft): one
    # token per draft slot, `drafts` empty; the reply's `proposed` says which.
    worker_drafts: bool = False


@dataclass
class EmbedRow:
    """One input of an EmbedReq: `index` is its place among the request's inputs."""

    rid: str
    index: int
    input_ids: list[int]


@dataclass
class EmbedBatch:
    """Rows to embed (worker_mlx/embed_pass.py): forward passes with no cache kept, so
    the KV pool, the decode buffer and the releases are not part of it."""

    step: int
    rows: list[EmbedRow]


@dataclass
class EmbedResult:
    """Per row of the EmbedBatch, in its order, the embedding as EmbedOut's."""

    step: int
    embeddings: list[bytes]


@dataclass
class BlockSave:
    """One whole block of a finished request for the disk tier: its chained key
    (common/kv_store/block_keys.py), its parent's key, its tokens and the pool slots that
    hold their KV (read after the release's flush, before any slot is reused); for a
    model with recurrent layers, `state_slot` (0: none) holds the state after the block's
    last token, stored beside it (`state_key`) so a prefix can resume there. For a
    sliding-window model the block holds its full-attention layers' KV, and `window`
    asks for the sliding layers' too, stored beside it (`window_key`)."""

    key: str
    parent: str
    tokens: list[int]
    slots: list[int]
    state_slot: int = 0
    window: bool = False


@dataclass
class ReleaseBatch:
    step: int
    release: list[ReleaseReq]
    # disk tier: blocks to copy out of the pool (then written by the worker's writer thread),
    # and keys of blocks on disk a finished request used again (most recently used now)
    save: list[BlockSave] = field(default_factory=list)
    touch: list[str] = field(default_factory=list)


@dataclass
class BlockLoad:
    """A block to read from the disk tier into fresh pool slots: its tokens from `offset`
    on (the first `offset` are in the pool already) go to `slots`, one each. For a model
    with recurrent layers, the last block of a prompt's load also brings the state at its
    end (`state_key`) into `state_slot` (0: none). For a sliding-window model, `window`:
    the sliding layers' KV is read too (`window_key`); else their slots are left as they
    are, which no match ending in the trie reads (scheduler/sliding_windows.py)."""

    key: str
    offset: int
    slots: list[int]
    state_slot: int = 0
    window: bool = False


@dataclass
class LoadBatch:
    """Read blocks of a prompt's prefix from the disk tier into the pool; answered with
    BlocksLoaded. The blocks chain: one that fails ends the load there."""

    step: int
    loads: list[BlockLoad]
    release: list[ReleaseReq] = field(default_factory=list)


@dataclass
class HoldAhead:
    """Scheduler -> worker while DecodeBatch `step` (sent with `lookahead`) is in flight:
    a prompt arrived meanwhile, so its extend, not that decode step's successor, is the
    likely next descriptor. The worker computes no step ahead after `step` (one computed
    ahead would run before the extend). Nothing answers it."""

    step: int


@dataclass
class GroupInstall:
    """Rank 0 of a distributed worker -> the other ranks (never the scheduler): rank 0
    read its part of LoadBatch `step`; every rank now waits for its own, the group agrees
    how many blocks all ranks read (the shortest) and each installs that many."""

    step: int


@dataclass
class DiskReport:
    """The disk tier's state and what happened since the worker's previous report:
    `errors` by reason, the seconds of each block read and write, the keys the store
    dropped (budget, damage), which the scheduler forgets, and those it found added."""

    bytes: int
    blocks: int
    errors: dict[str, int] = field(default_factory=dict)
    read_seconds: list[float] = field(default_factory=list)
    write_seconds: list[float] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    # blocks other servers sharing the directory wrote, found by the worker's rescan
    added: list[str] = field(default_factory=list)
    writable: bool = True  # False: the directory cannot be written (no more saves)


@dataclass
class BlocksLoaded:
    """The answer to a LoadBatch: how many of its loads (in order) are in the pool."""

    step: int
    loaded: int
    disk: DiskReport | None = None


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
    # A `worker_drafts` step: per row, the drafts the worker's draft model proposed and
    # the step verified ([] for a row without draft slots).
    proposed: list[list[int]] | None = None
    # With a draft model in the worker: per row, its guess of the token this step
    # produced, for a row that did not draft (its shadow proposal; None for one that did).
    guesses: list[int | None] | None = None
    # A decode step the worker computed on receipt: its seconds, from the descriptor to
    # the tokens on the host (None for an extend, or a step computed ahead). The
    # scheduler weighs a verify step's cost against a plain one's with it.
    step_seconds: float | None = None
    # the disk tier's news since the last report (None: nothing new, or no tier)
    disk: DiskReport | None = None
    # A vision model's worker: its vision-tower runs and tower-cache hits so far
    # (worker_mlx/vision_pass.py), cumulative; None for a text model.
    vision_counts: list[int] | None = None


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
    # the width of its embeddings (the hidden size); 0: the model cannot embed
    embedding_dim: int = 0
    embedding_normalized: bool = True
    # False: an embedding model's body without an LM head (worker_mlx/headless.py)
    generates: bool = True
    # the disk tier (--kv-disk-dir): the keys of the blocks it holds and its block size;
    # None when the tier is off or this model cannot use it
    disk_blocks: list[str] | None = None
    disk_block_tokens: int = 0
    # the largest sliding window of its layers (0: none): blocks store those layers'
    # KV only where a later prompt attends it (scheduler/disk_tier.py)
    disk_window: int = 0


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


SCHEDULER_FROM_ROUTER = _registry(GenerateReq, AbortReq, EmbedReq, LoraUpdate)
SCHEDULER_FROM_WORKER = _registry(
    WorkerReady, StepResult, WorkerError, EmbedResult, BlocksLoaded, LoraUpdated
)
ROUTER_INBOX = _registry(
    TokenOutBatch,
    ReqError,
    SchedulerReady,
    SchedulerStats,
    CacheEvicted,
    WorkerHung,
    EmbedOut,
    DiskReport,
    LoraUpdated,
)
WORKER_INBOX = _registry(
    ExtendBatch, DecodeBatch, ReleaseBatch, EmbedBatch, LoadBatch, LoraUpdate, HoldAhead
)
# a distributed worker's rank > 0: what rank 0 forwards, and what it adds itself
RANK_INBOX = {**WORKER_INBOX, **_registry(GroupInstall)}
REPLICA_INBOX = _registry(GenerateReq, AbortReq, ReplicaPing, EmbedReq)
REPLICA_CONTROL_INBOX = _registry(ReplicaStatus, ReplicaFrameError)
