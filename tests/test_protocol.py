"""Wire codec: every message round-trips, and every kind of bad frame raises its own error."""

from __future__ import annotations

import math

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common import messages
from common.messages import (
    CLIENT_INBOX,
    FRONTDOOR_INBOX,
    ROUTER_INBOX,
    SCHEDULER_FROM_ROUTER,
    SCHEDULER_FROM_WORKER,
    WORKER_INBOX,
    AbortReq,
    BlockLoad,
    BlockSave,
    BlocksLoaded,
    CacheEvicted,
    ClientAbort,
    ClientError,
    ClientGenerate,
    ClientResult,
    DecodeBatch,
    DiskReport,
    EmbedBatch,
    EmbedOut,
    EmbedReq,
    EmbedResult,
    EmbedRow,
    ExtendBatch,
    ExtendReq,
    GenerateReq,
    GroupInstall,
    HoldAhead,
    LoadBatch,
    LoraUpdate,
    LoraUpdated,
    ModelIdentity,
    ReleaseBatch,
    ReleaseReq,
    ReplicaFrameError,
    ReplicaPing,
    ReplicaStatus,
    ReqError,
    SamplingParams,
    SchedulerReady,
    SchedulerStats,
    StepResult,
    TokenOut,
    TokenOutBatch,
    WorkerError,
    WorkerHung,
    WorkerReady,
)
from common.protocol import (
    PROTOCOL_VERSION,
    TYPE_KEY,
    VERSION_KEY,
    FieldTypeError,
    MalformedFrameError,
    MissingFieldError,
    ProtocolError,
    UnknownMessageError,
    VersionMismatchError,
    decode,
    encode,
    peek_rid,
)

# Every module-level registry in common.messages, discovered so a new one is covered too.
REGISTRIES: dict[str, dict[str, type]] = {
    name: value
    for name, value in vars(messages).items()
    if name.isupper()
    and isinstance(value, dict)
    and all(isinstance(v, type) for v in value.values())
}

# ---------------------------------------------------------------- representative instances

SP_FULL = SamplingParams(
    max_new_tokens=77,
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    min_p=0.05,
    repetition_penalty=1.1,
    frequency_penalty=-0.5,
    presence_penalty=1.5,
    seed=1234,
    stop_token_ids=[2, 7],
    ignore_eos=True,
    logprobs=True,
    top_logprobs=5,
)
TOP_LOGPROBS = [  # per token: [[token_id, logprob], ...]
    [[5, -0.125], [9, -2.5]],
    [],
]
TOKEN_OUT_FULL = TokenOut(
    rid="t1",
    token_ids=[5, 6],
    finish_reason="stop",
    prompt_tokens=12,
    completion_tokens=2,
    cached_tokens=8,
    logprobs=[-0.125, -1.0],
    top_logprobs=TOP_LOGPROBS,
)
TOKEN_OUT_BARE = TokenOut(
    rid="t2",
    token_ids=[],
    finish_reason=None,
    prompt_tokens=3,
    completion_tokens=0,
    cached_tokens=0,
)
EXTEND_REQS = [
    ExtendReq(
        rid="e1",
        input_ids=[10, 11, 12],
        prefix_slot_ids=[1, 2],
        out_cache_loc=[3, 4, 5],
        sampling=SP_FULL,
        last_chunk=False,
    ),
    ExtendReq(
        rid="e2", input_ids=[1], prefix_slot_ids=[], out_cache_loc=[6], sampling=SamplingParams()
    ),
]
RELEASES = [ReleaseReq(rid="x", flush=True), ReleaseReq(rid="y", flush=False)]
IDENTITY = ModelIdentity(model_type="qwen3", vocab_size=512, digest="ab" * 32)

DISK = DiskReport(
    bytes=4096,
    blocks=2,
    errors={"checksum": 1},
    read_seconds=[0.001],
    write_seconds=[0.5],
    dropped=["ab" * 16],
)
EXAMPLES: dict[type, list] = {
    GenerateReq: [
        GenerateReq(rid="g1", input_ids=[1, 2, 3], sampling=SP_FULL),
        GenerateReq(rid="", input_ids=[], sampling=SamplingParams()),
    ],
    AbortReq: [AbortReq(rid="a1")],
    TokenOutBatch: [
        TokenOutBatch(outputs=[TOKEN_OUT_FULL, TOKEN_OUT_BARE]),
        TokenOutBatch(outputs=[]),
    ],
    ReqError: [
        ReqError(rid="r1", message="too long", code="context_length_exceeded", status=413),
        ReqError(rid="r2", message="bad"),
    ],
    SchedulerReady: [
        SchedulerReady(
            num_slots=4096, max_running_requests=16, context_len=2048, model_type="qwen3"
        )
    ],
    SchedulerStats: [
        SchedulerStats(
            num_running=3,
            num_queued=2,
            token_usage=0.25,
            capacity=4096,
            evicted_tokens=10,
            retracted_requests=1,
        )
    ],
    CacheEvicted: [CacheEvicted(paths=[[1, 2, 3], [7]]), CacheEvicted(paths=[])],
    WorkerHung: [WorkerHung(step=7, seconds=301.5)],
    ReplicaPing: [ReplicaPing(router="mac-1:4242")],
    ReplicaStatus: [
        ReplicaStatus(IDENTITY, "0a1b2c3d4e5f", "starting"),
        ReplicaStatus(
            IDENTITY,
            "0a1b2c3d4e5f",
            "ready",
            "",
            SchedulerReady(num_slots=64, max_running_requests=8, context_len=512, model_type="x"),
        ),
    ],
    ReplicaFrameError: [ReplicaFrameError("expected 1 frame, got 3")],
    ExtendBatch: [
        ExtendBatch(step=5, reqs=EXTEND_REQS, release=RELEASES),
        ExtendBatch(step=0, reqs=EXTEND_REQS[:1]),
        ExtendBatch(step=1, reqs=[], release=[]),
    ],
    DecodeBatch: [
        DecodeBatch(step=6, rids=["a", "b"], out_cache_loc=[10, 11], release=RELEASES[:1]),
        DecodeBatch(step=7, rids=[], out_cache_loc=[]),
        DecodeBatch(  # the scheduler's n-gram drafts
            step=8,
            rids=["a", "b"],
            out_cache_loc=[10, 11],
            drafts=[[3, 4], []],
            draft_slots=[[12, 13], []],
        ),
        DecodeBatch(  # the worker's draft model asked for the drafts
            step=9,
            rids=["a", "b"],
            out_cache_loc=[10, 11],
            drafts=[[], []],
            draft_slots=[[12, 13], []],
            worker_drafts=True,
        ),
    ],
    ReleaseBatch: [
        ReleaseBatch(step=8, release=RELEASES),
        ReleaseBatch(step=9, release=[]),
        ReleaseBatch(
            step=10,
            release=[],
            save=[BlockSave("ab" * 16, "cd" * 16, [1, 2], [7, 8])],
            touch=["ef" * 16],
        ),
    ],
    LoadBatch: [
        LoadBatch(step=11, loads=[BlockLoad("ab" * 16, 1, [9])], release=RELEASES),
        LoadBatch(step=12, loads=[]),
    ],
    BlocksLoaded: [BlocksLoaded(step=11, loaded=1, disk=DISK), BlocksLoaded(step=12, loaded=0)],
    GroupInstall: [GroupInstall(step=11)],
    HoldAhead: [HoldAhead(step=11)],
    DiskReport: [DISK, DiskReport(bytes=0, blocks=0)],
    EmbedReq: [EmbedReq(rid="e", inputs=[[1, 2, 3], [4]])],
    EmbedOut: [EmbedOut(rid="e", embeddings=[b"\x00\x00\x80?", b""], prompt_tokens=4)],
    LoraUpdate: [LoraUpdate("u", 3, "a3", "/adapters/a3", step=7), LoraUpdate("u", 3, "a3")],
    LoraUpdated: [LoraUpdated("u", 3), LoraUpdated("u", 3, "no such adapter", step=7)],
    EmbedBatch: [EmbedBatch(step=10, rows=[EmbedRow("e", 0, [1, 2, 3]), EmbedRow("e", 1, [4])])],
    EmbedResult: [EmbedResult(step=10, embeddings=[b"\x00\x00\x80?"])],
    StepResult: [
        StepResult(
            step=3,
            rids=["a", "b"],
            next_token_ids=[5, 6],
            logprobs=[-0.125, -1.0],
            top_logprobs=TOP_LOGPROBS,
        ),
        StepResult(step=4, rids=["a"], next_token_ids=[7]),
        StepResult(  # a worker_drafts step: proposals for a, the draft's guess for b
            step=9,
            rids=["a", "b"],
            next_token_ids=[7, 8],
            accepted=[1, 0],
            proposed=[[3, 4], []],
            guesses=[None, 8],
        ),
    ],
    WorkerReady: [
        WorkerReady(
            num_slots=4096,
            model_type="llama",
            num_layers=2,
            n_kv_heads=2,
            head_dim=16,
            dtype="bfloat16",
            context_len=2048,
            vocab_size=256,
            eos_token_ids=[0, 1],
            blas="openblas",
        )
    ],
    WorkerError: [WorkerError(step=3, message="boom")],
    ClientGenerate: [
        ClientGenerate(rid="c1", sampling=SP_FULL, text="hello", stream=True),
        ClientGenerate(rid="c2", sampling=SamplingParams(), input_ids=[1, 2]),
        ClientGenerate(
            rid="c3",
            sampling=SamplingParams(temperature=0.0),
            messages=[{"role": "user", "content": "hi"}],
        ),
        ClientGenerate(rid="c4", sampling=SamplingParams()),
    ],
    ClientAbort: [ClientAbort(rid="c1")],
    ClientResult: [
        ClientResult(
            rid="c1",
            token_ids=[5, 6],
            text="héllo ✓",
            finish_reason="length",
            prompt_tokens=4,
            completion_tokens=2,
            cached_tokens=0,
        ),
        ClientResult(
            rid="c1",
            token_ids=[],
            text="",
            finish_reason=None,
            prompt_tokens=4,
            completion_tokens=0,
            cached_tokens=2,
        ),
    ],
    ClientError: [
        ClientError(rid="c1", message="overloaded", code="server_error", status=503),
        ClientError(rid="c2", message="bad"),
    ],
}

REGISTRY_ENTRIES = [
    pytest.param(reg_name, cls, id=f"{reg_name}-{tag}")
    for reg_name, registry in REGISTRIES.items()
    for tag, cls in registry.items()
]


def frame(body) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def wire(msg, **overrides) -> dict:
    """The raw map `encode` produces for `msg`, with some keys replaced (None value: removed)."""
    body = msgpack.unpackb(encode(msg), raw=False)
    for key, value in overrides.items():
        if value is None:
            body.pop(key, None)
        else:
            body[key] = value
    return body


# ---------------------------------------------------------------- round trips


def test_known_registries_are_discovered():
    assert {
        "SCHEDULER_FROM_ROUTER",
        "SCHEDULER_FROM_WORKER",
        "ROUTER_INBOX",
        "WORKER_INBOX",
        "FRONTDOOR_INBOX",
        "CLIENT_INBOX",
    } <= set(REGISTRIES)


def test_every_registered_message_has_an_example():
    registered = {cls for registry in REGISTRIES.values() for cls in registry.values()}
    missing = sorted(c.__name__ for c in registered - set(EXAMPLES))
    assert not missing, f"add round-trip examples for: {missing}"
    unregistered = sorted(c.__name__ for c in set(EXAMPLES) - registered)
    assert not unregistered, f"examples for unregistered messages: {unregistered}"


def test_registry_tags_are_class_names():
    for registry in REGISTRIES.values():
        for tag, cls in registry.items():
            assert tag == cls.__name__


@pytest.mark.parametrize("reg_name, cls", REGISTRY_ENTRIES)
def test_round_trip(reg_name, cls):
    registry = REGISTRIES[reg_name]
    examples = EXAMPLES.get(cls)
    assert examples, f"no round-trip example for {cls.__name__}"
    for msg in examples:
        assert type(msg) is cls
        data = encode(msg)
        assert isinstance(data, bytes)
        raw = msgpack.unpackb(data, raw=False)
        assert raw[TYPE_KEY] == cls.__name__
        assert raw[VERSION_KEY] == PROTOCOL_VERSION
        got = decode(data, registry)
        assert type(got) is cls
        assert got == msg
        assert encode(got) == data


def test_nested_types_are_rebuilt():
    got = decode(encode(EXAMPLES[ExtendBatch][0]), WORKER_INBOX)
    assert all(type(r) is ExtendReq for r in got.reqs)
    assert all(type(r.sampling) is SamplingParams for r in got.reqs)
    assert all(type(r) is ReleaseReq for r in got.release)
    got = decode(encode(EXAMPLES[TokenOutBatch][0]), ROUTER_INBOX)
    assert all(type(o) is TokenOut for o in got.outputs)
    assert type(got.outputs[0].logprobs[0]) is float


def test_messages_are_rejected_by_every_other_registry():
    for registry in REGISTRIES.values():
        for cls, examples in EXAMPLES.items():
            if cls in registry.values():
                continue
            with pytest.raises(UnknownMessageError, match=cls.__name__):
                decode(encode(examples[0]), registry)


# ---------------------------------------------------------------- bad frames


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # a byte msgpack never uses
        b"\x01\x02",  # trailing data
        encode(AbortReq(rid="a1"))[:-2],  # truncated
        frame({1: 2, "type": "AbortReq"}),  # non-string map key
    ],
    ids=["empty", "reserved-byte", "extra-data", "truncated", "int-key"],
)
def test_not_msgpack_is_malformed(data):
    with pytest.raises(MalformedFrameError, match="not a msgpack frame"):
        decode(data, SCHEDULER_FROM_ROUTER)


@pytest.mark.parametrize(
    "body, kind", [([1, 2], "list"), (5, "int"), ("AbortReq", "str"), (None, "NoneType")]
)
def test_non_map_is_malformed(body, kind):
    with pytest.raises(MalformedFrameError, match=f"frame is a {kind}, expected a map"):
        decode(frame(body), SCHEDULER_FROM_ROUTER)


def test_error_classes_are_protocol_errors():
    for cls in (
        MalformedFrameError,
        UnknownMessageError,
        VersionMismatchError,
        MissingFieldError,
        FieldTypeError,
    ):
        assert issubclass(cls, ProtocolError)
        assert issubclass(cls, ValueError)


@pytest.mark.parametrize("tag", [None, 5, b"AbortReq"], ids=["absent", "int", "bytes"])
def test_missing_type_tag(tag):
    body = {"rid": "a1", VERSION_KEY: PROTOCOL_VERSION}
    if tag is not None:
        body[TYPE_KEY] = tag
    with pytest.raises(MissingFieldError, match="'type' tag"):
        decode(frame(body), SCHEDULER_FROM_ROUTER)


def test_unknown_tag():
    body = {TYPE_KEY: "FlyToMoon", VERSION_KEY: PROTOCOL_VERSION, "rid": "a1"}
    with pytest.raises(UnknownMessageError, match="FlyToMoon"):
        decode(frame(body), SCHEDULER_FROM_ROUTER)


def test_wrong_registry():
    data = encode(EXAMPLES[GenerateReq][0])
    with pytest.raises(UnknownMessageError, match="unknown message type 'GenerateReq'"):
        decode(data, WORKER_INBOX)
    with pytest.raises(UnknownMessageError, match="ExtendBatch"):
        decode(encode(EXAMPLES[ExtendBatch][0]), SCHEDULER_FROM_ROUTER)


@pytest.mark.parametrize(
    "version", [None, PROTOCOL_VERSION + 1, 0, str(PROTOCOL_VERSION), float(PROTOCOL_VERSION) + 0.5]
)
def test_version_mismatch(version):
    body = wire(AbortReq(rid="a1"))
    body.pop(VERSION_KEY)
    if version is not None:
        body[VERSION_KEY] = version
    with pytest.raises(VersionMismatchError, match=rf"AbortReq: protocol version {version!r}"):
        decode(frame(body), SCHEDULER_FROM_ROUTER)


@pytest.mark.parametrize(
    "msg, registry, field_name",
    [
        (EXAMPLES[GenerateReq][0], SCHEDULER_FROM_ROUTER, "rid"),
        (EXAMPLES[GenerateReq][0], SCHEDULER_FROM_ROUTER, "input_ids"),
        (EXAMPLES[GenerateReq][0], SCHEDULER_FROM_ROUTER, "sampling"),
        (EXAMPLES[ExtendBatch][0], WORKER_INBOX, "reqs"),
        (EXAMPLES[WorkerReady][0], SCHEDULER_FROM_WORKER, "blas"),
        (EXAMPLES[ClientResult][0], CLIENT_INBOX, "finish_reason"),  # Optional but required
    ],
)
def test_missing_required_field(msg, registry, field_name):
    body = wire(msg)
    del body[field_name]
    with pytest.raises(
        MissingFieldError, match=f"{type(msg).__name__}: missing field '{field_name}'"
    ):
        decode(frame(body), registry)


def test_missing_required_nested_field():
    body = wire(EXAMPLES[ExtendBatch][0])
    del body["reqs"][1]["out_cache_loc"]
    with pytest.raises(
        MissingFieldError, match=r"ExtendBatch\.reqs\[1\]: missing field 'out_cache_loc'"
    ):
        decode(frame(body), WORKER_INBOX)
    body = wire(EXAMPLES[ReleaseBatch][0])
    del body["release"][0]["flush"]
    with pytest.raises(
        MissingFieldError, match=r"ReleaseBatch\.release\[0\]: missing field 'flush'"
    ):
        decode(frame(body), WORKER_INBOX)


GEN = EXAMPLES[GenerateReq][0]
EXT = EXAMPLES[ExtendBatch][0]
TOB = EXAMPLES[TokenOutBatch][0]
READY = EXAMPLES[SchedulerReady][0]
STATS = EXAMPLES[SchedulerStats][0]
CGEN = EXAMPLES[ClientGenerate][3]
R_SR, R_SW, R_RI, R_WI, R_FD = (
    SCHEDULER_FROM_ROUTER,
    SCHEDULER_FROM_WORKER,
    ROUTER_INBOX,
    WORKER_INBOX,
    FRONTDOOR_INBOX,
)

# (message, path to the replaced value, bad value, registry, field path in the error)
BAD_TYPES = [
    # int
    (READY, ["num_slots"], "1", R_RI, "SchedulerReady.num_slots"),
    (READY, ["num_slots"], 1.0, R_RI, "SchedulerReady.num_slots"),
    (READY, ["num_slots"], True, R_RI, "SchedulerReady.num_slots"),  # bool is not an int
    (READY, ["num_slots"], None, R_RI, "SchedulerReady.num_slots"),
    (GEN, ["sampling", "max_new_tokens"], False, R_SR, "GenerateReq.sampling.max_new_tokens"),
    (GEN, ["sampling", "seed"], "7", R_SR, "GenerateReq.sampling.seed"),  # Optional[int]
    # str
    (GEN, ["rid"], 5, R_SR, "GenerateReq.rid"),
    (GEN, ["rid"], b"bytes", R_SR, "GenerateReq.rid"),
    (AbortReq("a"), ["rid"], None, R_SR, "AbortReq.rid"),
    (READY, ["model_type"], ["qwen3"], R_RI, "SchedulerReady.model_type"),
    (CGEN, ["text"], 7, R_FD, "ClientGenerate.text"),  # Optional[str]
    # bool
    (EXT, ["release", 0, "flush"], 1, R_WI, "ExtendBatch.release[0].flush"),
    (EXT, ["reqs", 0, "last_chunk"], "no", R_WI, "ExtendBatch.reqs[0].last_chunk"),
    (CGEN, ["stream"], 0, R_FD, "ClientGenerate.stream"),
    # float
    (STATS, ["token_usage"], "0.5", R_RI, "SchedulerStats.token_usage"),
    (STATS, ["token_usage"], True, R_RI, "SchedulerStats.token_usage"),
    (GEN, ["sampling", "temperature"], "hot", R_SR, "GenerateReq.sampling.temperature"),
    (GEN, ["sampling", "top_p"], None, R_SR, "GenerateReq.sampling.top_p"),
    # list[int] and its elements
    (GEN, ["input_ids"], [1, "2"], R_SR, "GenerateReq.input_ids[1]"),
    (GEN, ["input_ids"], [1, 2.0], R_SR, "GenerateReq.input_ids[1]"),
    (GEN, ["input_ids"], [1, True], R_SR, "GenerateReq.input_ids[1]"),
    (GEN, ["input_ids"], [None], R_SR, "GenerateReq.input_ids[0]"),
    (GEN, ["input_ids"], "123", R_SR, "GenerateReq.input_ids"),
    (GEN, ["input_ids"], {"a": 1}, R_SR, "GenerateReq.input_ids"),
    (GEN, ["sampling", "stop_token_ids"], [2, "x"], R_SR, "GenerateReq.sampling.stop_token_ids[1]"),
    (CGEN, ["input_ids"], [1, "x"], R_FD, "ClientGenerate.input_ids[1]"),  # Optional[list[int]]
    # list[str] / list[float] / list[dict] elements
    (EXAMPLES[DecodeBatch][0], ["rids", 1], 1, R_WI, "DecodeBatch.rids[1]"),
    (EXAMPLES[StepResult][0], ["logprobs", 1], "x", R_SW, "StepResult.logprobs[1]"),
    (CGEN, ["messages"], ["hi"], R_FD, "ClientGenerate.messages[0]"),
    (CGEN, ["messages"], "hi", R_FD, "ClientGenerate.messages"),
    # nested dataclass
    (GEN, ["sampling"], 5, R_SR, "GenerateReq.sampling"),
    (GEN, ["sampling"], [1, 2], R_SR, "GenerateReq.sampling"),
    (GEN, ["sampling"], None, R_SR, "GenerateReq.sampling"),
    (EXT, ["reqs", 1, "sampling"], "greedy", R_WI, "ExtendBatch.reqs[1].sampling"),
    (EXT, ["reqs", 1, "sampling", "top_k"], 1.5, R_WI, "ExtendBatch.reqs[1].sampling.top_k"),
    # list of nested dataclass
    (EXT, ["reqs"], [5], R_WI, "ExtendBatch.reqs[0]"),
    (EXT, ["reqs"], {"rid": "x"}, R_WI, "ExtendBatch.reqs"),
    (EXT, ["release", 1], "y", R_WI, "ExtendBatch.release[1]"),
    (EXT, ["reqs", 0, "input_ids"], [1, "a"], R_WI, "ExtendBatch.reqs[0].input_ids[1]"),
    (TOB, ["outputs", 1, "token_ids"], 5, R_RI, "TokenOutBatch.outputs[1].token_ids"),
    (TOB, ["outputs", 0, "finish_reason"], 3, R_RI, "TokenOutBatch.outputs[0].finish_reason"),
    (TOB, ["outputs", 0, "top_logprobs"], [{}], R_RI, "TokenOutBatch.outputs[0].top_logprobs[0]"),
]


@pytest.mark.parametrize(
    "msg, path, value, registry, where", BAD_TYPES, ids=[case[-1] for case in BAD_TYPES]
)
def test_wrong_field_type(msg, path, value, registry, where):
    body = wire(msg)
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(FieldTypeError) as info:
        decode(frame(body), registry)
    message = str(info.value)
    assert message.startswith(f"{where}: expected"), message


def test_int_accepted_for_float_and_widened():
    body = wire(STATS, token_usage=1)
    got = decode(frame(body), ROUTER_INBOX)
    assert got.token_usage == 1.0
    assert type(got.token_usage) is float
    body = wire(GEN)
    body["sampling"].update(temperature=0, top_p=1, repetition_penalty=2, frequency_penalty=-1)
    got = decode(frame(body), SCHEDULER_FROM_ROUTER)
    for name in ("temperature", "top_p", "repetition_penalty", "frequency_penalty"):
        assert type(getattr(got.sampling, name)) is float, name
    assert got.sampling.temperature == 0.0 and got.sampling.greedy
    body = wire(EXAMPLES[StepResult][0], logprobs=[-1, 0])
    got = decode(frame(body), SCHEDULER_FROM_WORKER)
    assert got.logprobs == [-1.0, 0.0]
    assert all(type(x) is float for x in got.logprobs)


def test_optional_and_defaulted_fields_may_be_omitted():
    body = {TYPE_KEY: "TokenOutBatch", VERSION_KEY: PROTOCOL_VERSION, "outputs": []}
    body["outputs"].append(
        {
            "rid": "t",
            "token_ids": [1],
            "finish_reason": None,
            "prompt_tokens": 1,
            "completion_tokens": 1,
            "cached_tokens": 0,
        }
    )
    got = decode(frame(body), ROUTER_INBOX)
    assert got.outputs[0].logprobs is None and got.outputs[0].top_logprobs is None

    body = {TYPE_KEY: "GenerateReq", VERSION_KEY: PROTOCOL_VERSION}
    body.update(rid="g", input_ids=[1], sampling={})
    got = decode(frame(body), SCHEDULER_FROM_ROUTER)
    assert got.sampling == SamplingParams()

    body = {TYPE_KEY: "ClientGenerate", VERSION_KEY: PROTOCOL_VERSION, "rid": "c", "sampling": {}}
    got = decode(frame(body), FRONTDOOR_INBOX)
    assert got == ClientGenerate(rid="c", sampling=SamplingParams())

    body = {TYPE_KEY: "ExtendBatch", VERSION_KEY: PROTOCOL_VERSION, "step": 1, "reqs": []}
    got = decode(frame(body), WORKER_INBOX)
    assert got.release == []
    body = {TYPE_KEY: "ReqError", VERSION_KEY: PROTOCOL_VERSION, "rid": "r", "message": "m"}
    assert decode(frame(body), ROUTER_INBOX) == ReqError(rid="r", message="m")


def test_optional_fields_may_be_none():
    body = wire(CGEN)
    assert body["text"] is None and body["input_ids"] is None and body["messages"] is None
    body["sampling"]["seed"] = None
    got = decode(frame(body), FRONTDOOR_INBOX)
    assert got.text is None and got.input_ids is None and got.messages is None
    assert got.sampling.seed is None


def test_unknown_extra_fields_are_ignored():
    got = decode(frame(wire(AbortReq("a"), future_field=1)), SCHEDULER_FROM_ROUTER)
    assert got == AbortReq("a")


# ---------------------------------------------------------------- peek_rid


def test_peek_rid():
    assert peek_rid(encode(AbortReq(rid="a1"))) == "a1"
    assert peek_rid(frame(wire(GEN, input_ids="bad"))) == "g1"  # FieldTypeError frame
    assert peek_rid(frame(wire(GEN, v=99))) == "g1"  # VersionMismatchError frame
    assert peek_rid(frame({"rid": "x"})) == "x"  # no type tag
    assert peek_rid(frame({"type": "Nope", "rid": "y"})) == "y"  # unknown type
    assert peek_rid(frame({"rid": 5})) is None
    assert peek_rid(frame({"type": "AbortReq"})) is None
    assert peek_rid(frame(["rid", "x"])) is None
    assert peek_rid(b"\xc1") is None
    assert peek_rid(b"") is None
    assert peek_rid(encode(AbortReq(rid="a1"))[:-1]) is None


# ---------------------------------------------------------------- SamplingParams.validate


def test_sampling_defaults_are_valid():
    SamplingParams().validate()
    SamplingParams().validate(vocab_size=10)
    SP_FULL.validate(vocab_size=100)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"repetition_penalty": 1e-3},
        {"frequency_penalty": -2.0, "presence_penalty": 2.0},
        {"frequency_penalty": 2.0, "presence_penalty": -2.0},
        {"top_logprobs": 20},
        {"max_new_tokens": 1},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"stop_token_ids": [0, 9]},
        {"logit_bias": {"0": -100, "9": 100.0}},
        {"logit_bias": {3: 1.5}},
    ],
)
def test_sampling_boundaries_are_valid(kwargs):
    SamplingParams(**kwargs).validate(vocab_size=10)


NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": NAN}, "temperature"),
        ({"temperature": INF}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": NAN}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"logit_bias": {"10": 1.0}}, "logit_bias keys"),
        ({"logit_bias": {"-1": 1.0}}, "logit_bias keys"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias keys"),
        ({"logit_bias": {"1": 100.5}}, "logit_bias values"),
        ({"logit_bias": {"1": NAN}}, "logit_bias values"),
        ({"logit_bias": {"1": "1"}}, "logit_bias values"),
        ({"logit_bias": [[1, 2.0]]}, "logit_bias must map"),
        ({"min_p": 1.01}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": NAN}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": INF}, "repetition_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": 2.01}, "frequency_penalty"),
        ({"frequency_penalty": NAN}, "frequency_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"presence_penalty": 2.01}, "presence_penalty"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": -1}, "top_logprobs"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": -5}, "max_new_tokens"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"stop_token_ids": [10]}, "stop_token_ids"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
    ],
)
def test_sampling_rejects_out_of_range(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs).validate(vocab_size=10)


def test_stop_token_ids_unchecked_without_vocab():
    SamplingParams(stop_token_ids=[10**6]).validate()


def test_greedy():
    assert not SamplingParams().greedy
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams(temperature=0.5, top_k=2).greedy


# ---------------------------------------------------------------- property tests

ints = st.integers(min_value=0, max_value=2**31 - 1)
rids = st.text(max_size=12)
token_lists = st.lists(ints, max_size=8)


def _float(lo: float, hi: float):
    return st.floats(min_value=lo, max_value=hi, allow_nan=False, allow_infinity=False)


sampling_params = st.builds(
    SamplingParams,
    max_new_tokens=st.integers(min_value=1, max_value=4096),
    temperature=_float(0, 2),
    top_p=_float(1e-6, 1),
    top_k=st.integers(min_value=-1, max_value=1000),
    min_p=_float(0, 1),
    repetition_penalty=_float(1e-3, 4),
    frequency_penalty=_float(-2, 2),
    presence_penalty=_float(-2, 2),
    seed=st.one_of(st.none(), st.integers(min_value=0, max_value=2**63 - 1)),
    stop_token_ids=token_lists,
    ignore_eos=st.booleans(),
    logprobs=st.booleans(),
    top_logprobs=st.integers(min_value=0, max_value=20),
    logit_bias=st.dictionaries(st.integers(0, 10**6).map(str), _float(-100, 100), max_size=4),
)
generate_reqs = st.builds(GenerateReq, rid=rids, input_ids=token_lists, sampling=sampling_params)
extend_batches = st.builds(
    ExtendBatch,
    step=ints,
    reqs=st.lists(
        st.builds(
            ExtendReq,
            rid=rids,
            input_ids=token_lists,
            prefix_slot_ids=token_lists,
            out_cache_loc=token_lists,
            sampling=sampling_params,
            last_chunk=st.booleans(),
        ),
        max_size=4,
    ),
    release=st.lists(st.builds(ReleaseReq, rid=rids, flush=st.booleans()), max_size=4),
)


@settings(max_examples=60, deadline=None)
@given(generate_reqs)
def test_generate_req_round_trip_property(msg):
    msg.sampling.validate()
    assert decode(encode(msg), SCHEDULER_FROM_ROUTER) == msg


@settings(max_examples=60, deadline=None)
@given(extend_batches)
def test_extend_batch_round_trip_property(msg):
    assert decode(encode(msg), WORKER_INBOX) == msg


def test_a_lora_update_names_what_makes_it_unusable():
    assert LoraUpdate("u", 1, "a1", "/p").problem() is None
    assert "ids start at 1" in LoraUpdate("u", 0, "a1").problem()
    assert "without ':'" in LoraUpdate("u", 2, "b:a").problem()


# ---------------------------------------------------------------- the compiled codec

# Values a mutated field may take: every msgpack type, in lists and maps.
junk = st.recursive(
    st.none() | st.booleans() | ints | st.floats(allow_nan=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=6,
)


def _mutations(body: dict, draw) -> dict:
    """The body with one field (of it, of a nested map or of a list's map) replaced,
    dropped, or one item of a list field replaced."""
    maps = [body]
    for value in body.values():
        maps += [value] if isinstance(value, dict) else []
        maps += [x for x in value if isinstance(x, dict)] if isinstance(value, list) else []
    target = draw(st.sampled_from(maps))
    if target:
        key = draw(st.sampled_from(sorted(target)))
        how = draw(st.sampled_from(["replace", "drop", "item"]))
        if how == "item" and isinstance(target[key], list) and target[key]:
            target[key][draw(st.integers(0, len(target[key]) - 1))] = draw(junk)
        elif how == "drop":
            del target[key]
        else:
            target[key] = draw(junk)
    return body


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_the_compiled_decoder_accepts_what_the_generic_one_does(data):
    """Every example with one field replaced by any msgpack value, or dropped: the compiled
    decoder (the fast path of every frame) returns what the generic walk returns, or
    refuses the frame as it does, with the same error."""
    from radix_mlx import protocol

    cls = data.draw(st.sampled_from(sorted(EXAMPLES, key=lambda c: c.__name__)))
    msg = data.draw(st.sampled_from(EXAMPLES[cls]))
    body = msgpack.unpackb(encode(msg), raw=False)
    tag = body.pop(TYPE_KEY)
    body.pop(VERSION_KEY)
    body = _mutations(body, data.draw)
    try:
        expected = protocol._from_wire(cls, body, tag)
    except ProtocolError as exc:
        expected = exc
    frame = msgpack.packb({**body, TYPE_KEY: tag, VERSION_KEY: PROTOCOL_VERSION})
    registry = {tag: cls}
    if isinstance(expected, ProtocolError):
        with pytest.raises(type(expected)) as got:
            decode(frame, registry)
        assert str(got.value) == str(expected)
        with pytest.raises(protocol._Invalid):
            protocol._decoder(cls)(body)  # the fast path refused it itself
    else:
        assert decode(frame, registry) == expected
        assert protocol._decoder(cls)(body) == expected  # not through the fallback
