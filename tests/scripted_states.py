"""The scripted worker's shadow of the recurrent-state pool (models with recurrent layers).

Each state slot holds the identity of the token sequence whose state it is (the `Seq` key of
its last token, see tests/scripted_worker.py), written where the descriptors say the worker
writes states: a request's working slot after each extend piece and decode step, the
`snapshots` of an extend, a release's `snapshot`. Every read is checked against that: a
`prefix_state` must hold the state after exactly the prefix, so a slot reused while
someone still relies on it, or a snapshot attached to the wrong trie node, shows up as a
violation when it is next read.
"""

from __future__ import annotations

from collections.abc import Callable

from common.messages import ExtendReq, ReleaseReq


class ShadowStates:
    def __init__(self, num_state_slots: int, bad: Callable[[str], None]):
        self.n = num_state_slots
        self._bad = bad
        self.content: list[int | None] = [None] * (num_state_slots + 1)
        self.working: dict[str, int] = {}  # live request -> its working state slot
        self.release_snapshots: dict[str, list[int]] = {}  # every ReleaseReq.snapshot, per rid

    def _slot_ok(self, slot: int, where: str, what: str) -> bool:
        if not 1 <= slot <= self.n:
            self._bad(f"{where}: {what} {slot} outside 1..{self.n}")
            return False
        return True

    def extend(self, step: int, reqs: list[ExtendReq], keys: dict[str, list[int]]) -> None:
        """Check and apply one ExtendBatch's state fields; `keys[rid]` are the request's
        sequence identities (keys[i] names its first i + 1 tokens)."""
        if self.n == 0:
            for r in reqs:
                if r.state_slot or r.prefix_state or r.snapshots:
                    self._bad(f"step {step} extend {r.rid}: state fields without state slots")
            return
        reads = {r.prefix_state for r in reqs if r.prefix_state and r.rid not in self.working}
        writes: set[int] = set()
        for r in reqs:
            where = f"step {step} extend {r.rid}"
            k = keys.get(r.rid)
            if k is None or not self._slot_ok(r.state_slot, where, "state_slot"):
                continue
            self._check_prefix(r, k, where)
            out = [r.state_slot] + [slot for _, slot in r.snapshots]
            others = {s for rid, s in self.working.items() if rid != r.rid}
            for slot in out:
                if slot in writes or slot in reads or slot in others:
                    self._bad(f"{where}: state slot {slot} is written while also in use")
                writes.add(slot)
            self.working[r.rid] = r.state_slot
            p = len(r.prefix_slot_ids)
            for n, slot in r.snapshots:
                if not 1 <= n <= len(r.input_ids):
                    self._bad(f"{where}: snapshot after {n} of {len(r.input_ids)} new tokens")
                elif self._slot_ok(slot, where, "snapshot"):
                    self.content[slot] = k[p + n - 1]
            self.content[r.state_slot] = k[p + len(r.input_ids) - 1]

    def _check_prefix(self, r: ExtendReq, k: list[int], where: str) -> None:
        p, own = len(r.prefix_slot_ids), self.working.get(r.rid)
        if own is not None and (r.state_slot != own or r.prefix_state != own):
            self._bad(f"{where}: a continuation must read and keep its state slot {own}")
        if p == 0:
            if r.prefix_state != 0:
                self._bad(f"{where}: prefix_state {r.prefix_state} with no prefix")
            return
        if not self._slot_ok(r.prefix_state, where, "prefix_state"):
            return
        if self.content[r.prefix_state] != k[p - 1]:
            self._bad(f"{where}: prefix_state {r.prefix_state} is not the state after {p} tokens")

    def decode(self, rid: str, key: int) -> None:
        """The request's decode step consumed the token named `key`."""
        if rid in self.working:
            self.content[self.working[rid]] = key
        elif self.n:
            self._bad(f"decode of {rid}, which has no working state slot")

    def release(self, r: ReleaseReq, key: int | None) -> None:
        """`key` names the last token the request has KV for (None: it had none)."""
        own = self.working.pop(r.rid, None)
        if not r.snapshot:
            return
        self.release_snapshots.setdefault(r.rid, []).append(r.snapshot)
        where = f"release of {r.rid}"
        if not r.flush:
            self._bad(f"{where}: a snapshot of a dropped request")
        if not self._slot_ok(r.snapshot, where, "snapshot"):
            return
        if r.snapshot == own or r.snapshot in self.working.values():
            self._bad(f"{where}: snapshot {r.snapshot} is a live working state slot")
        if own is None or self.content[own] != key:
            self._bad(f"{where}: the working state is not the state after its KV tokens")
        self.content[r.snapshot] = key
