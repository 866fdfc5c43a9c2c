"""Property tests (hypothesis): whatever bytes reach a receiver, its decoder either returns
a valid message or raises a ProtocolError, and the best-effort peeks used on bad frames
never raise. Inputs: random bytes, random msgpack values, and valid frames of every
message with fields removed, replaced by random values, truncated or bit-flipped."""

from __future__ import annotations

import dataclasses

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from common.messages import GenerateReq, SamplingParams
from common.protocol import ProtocolError, decode, encode, peek_rid, peek_rids, peek_step
from tests.test_protocol import EXAMPLES, REGISTRIES

VALID_FRAMES = [
    (reg, encode(msg))
    for reg, registry in REGISTRIES.items()
    for cls, msgs in EXAMPLES.items()
    if cls in registry.values()
    for msg in msgs
]
REGISTRY_NAMES = sorted(REGISTRIES)

# msgpack values of every kind, nested: what a mutated field may hold
leaves = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=20)
)  # fmt: skip
values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),  # fmt: skip
    max_leaves=12,
)


def _receive(frame: bytes, registry_name: str) -> None:
    """What every receiver does first with a frame; only a ProtocolError may come out."""
    for peek in (peek_rid, peek_rids, peek_step):
        peek(frame)
    try:
        msg = decode(frame, REGISTRIES[registry_name])
    except ProtocolError:
        return
    assert dataclasses.is_dataclass(msg)
    if isinstance(msg, GenerateReq):  # the scheduler validates the sampling it accepted
        _validate(msg.sampling)


def _validate(sampling: SamplingParams) -> None:
    try:
        sampling.validate(vocab_size=512)
    except ValueError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.sampled_from(REGISTRY_NAMES))
def test_random_bytes(data, registry_name):
    _receive(data, registry_name)


@settings(max_examples=300, deadline=None)
@given(values, st.sampled_from(REGISTRY_NAMES))
def test_random_msgpack_values(value, registry_name):
    _receive(msgpack.packb(value, use_bin_type=True), registry_name)


def _mutate(body: dict, key: str, replacement, remove: bool) -> dict:
    """`body` with one field (possibly nested one level) removed or replaced."""
    body = dict(body)
    target = body
    inner = body.get(key)
    if isinstance(inner, dict) and inner:  # e.g. sampling: mutate one of its fields
        target = body[key] = dict(inner)
        key = sorted(inner)[len(str(replacement)) % len(inner)]
    elif isinstance(inner, list) and inner and isinstance(inner[0], dict):
        target = dict(inner[0])
        body[key] = [target, *inner[1:]]
        key = sorted(target)[len(str(replacement)) % len(target)]
    if remove:
        target.pop(key, None)
    else:
        target[key] = replacement
    return body


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(VALID_FRAMES), st.data())
def test_mutated_valid_frames(valid, data):
    registry_name, frame = valid
    body = msgpack.unpackb(frame, raw=False)
    key = data.draw(st.sampled_from(sorted(body)))
    mutated = _mutate(body, key, data.draw(values), data.draw(st.booleans()))
    _receive(msgpack.packb(mutated, use_bin_type=True), registry_name)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(VALID_FRAMES), st.data())
def test_truncated_and_bit_flipped_frames(valid, data):
    registry_name, frame = valid
    cut = data.draw(st.integers(0, len(frame)))
    flipped = bytearray(frame)
    if flipped:
        i = data.draw(st.integers(0, len(flipped) - 1))
        flipped[i] ^= 1 << data.draw(st.integers(0, 7))
    _receive(frame[:cut], registry_name)
    _receive(bytes(flipped), registry_name)
    for name in REGISTRY_NAMES:  # a valid frame sent to the wrong receiver
        _receive(frame, name)
