"""What the worker checks in the scheduler's descriptors before it runs them: slot ids
inside its pools, token ids inside the vocabulary, state slots only for a model with
recurrent layers. A descriptor that fails is refused with the reason (the scheduler
fails its requests), never trusted into an out-of-bounds write."""

from __future__ import annotations

from common.image_keys import stray_pads
from common.messages import ExtendReq


def check_slots(rid: str, slots: list[int], num_slots: int) -> None:
    if slots and (min(slots) < 1 or max(slots) > num_slots):
        raise ValueError(f"{rid}: slot id outside the pool [1, {num_slots}]")


def check_extend(r: ExtendReq, num_slots: int, state_slots: int, vocab_size: int) -> None:
    if not r.input_ids:
        raise ValueError(f"{r.rid}: extend with no input tokens")
    if len(r.out_cache_loc) != len(r.input_ids):
        raise ValueError(f"{r.rid}: {len(r.input_ids)} tokens but {len(r.out_cache_loc)} slots")
    check_slots(r.rid, r.prefix_slot_ids, num_slots)
    check_slots(r.rid, r.out_cache_loc, num_slots)
    _check_states(r, state_slots)
    if min(r.input_ids) < 0 or max(r.input_ids) >= vocab_size:
        # images' pad values are above the vocabulary, inside their runs
        offset = len(r.prefix_slot_ids)
        if min(r.input_ids) < 0 or stray_pads(r.input_ids, offset, r.images, vocab_size):
            raise ValueError(f"{r.rid}: token id outside the vocabulary [0, {vocab_size})")
    r.sampling.validate(vocab_size)


def _check_states(r: ExtendReq, n: int) -> None:
    snaps = [slot for _, slot in r.snapshots]
    if not n:
        if r.state_slot or r.prefix_state or snaps:
            raise ValueError(f"{r.rid}: state slots for a model without recurrent layers")
        return
    if not 1 <= r.state_slot <= n or not all(1 <= s <= n for s in snaps):
        raise ValueError(f"{r.rid}: state slot outside [1, {n}]")
    if not 0 <= r.prefix_state <= n or (r.prefix_slot_ids and not r.prefix_state):
        raise ValueError(f"{r.rid}: a prefix needs the state slot of its recurrent state")
    if not all(1 <= at <= len(r.input_ids) for at, _ in r.snapshots):
        raise ValueError(f"{r.rid}: a snapshot outside its {len(r.input_ids)} tokens")
