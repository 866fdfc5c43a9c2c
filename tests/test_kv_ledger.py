"""The KV ledger: each decoding request's slot list, and where its KV is."""

from __future__ import annotations

import pytest

from worker_mlx.kv_ledger import KVLedger


class _Buffer:
    """A decode buffer's two answers the ledger asks: the row and columns of a request,
    and how many newest tokens are not flushed yet."""

    def __init__(self, place: dict, pending: int):
        self.place, self.n = place, pending

    def columns(self, rid: str):
        return self.place.get(rid)

    def pending(self) -> int:
        return self.n


def test_open_add_drop():
    ledger = KVLedger()
    prefix = [3, 4, 5]
    ledger.open("a", prefix)
    prefix.append(9)  # the ledger keeps its own list
    ledger.add("a", [6])
    ledger.add("a", [7, 8])
    assert ledger.slots("a") == [3, 4, 5, 6, 7, 8] and "a" in ledger
    ledger.drop("a")
    ledger.drop("a")  # a request released twice (an abort after a finish) is no error
    assert "a" not in ledger
    with pytest.raises(KeyError):
        ledger.slots("a")


def test_where_splits_the_pool_from_the_unflushed_buffer():
    ledger = KVLedger()
    ledger.open("a", [1, 2, 3])
    ledger.add("a", [4])
    ledger.add("a", [5])
    where = ledger.where("a", None)
    assert (where.pool_slots, where.buffered_slots, where.row) == ([1, 2, 3, 4, 5], [], None)
    where = ledger.where("a", _Buffer({"a": (1, range(2, 7))}, pending=2))
    assert where.pool_slots == [1, 2, 3] and where.buffered_slots == [4, 5]
    assert (where.row, where.columns) == (1, range(2, 7))
    where = ledger.where("a", _Buffer({}, pending=2))  # not in the buffer: all in the pool
    assert where.buffered_slots == [] and where.pool_slots == [1, 2, 3, 4, 5]
