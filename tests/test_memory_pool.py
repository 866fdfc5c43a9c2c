import pytest

from scheduler.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator

# ---- TokenToKVPoolAllocator ---------------------------------------------------------------------


def test_allocator_hands_out_1_to_size_never_0():
    a = TokenToKVPoolAllocator(8)
    assert a.capacity == 8
    assert a.available_size() == 8
    got = a.alloc(8)
    assert got is not None
    assert sorted(got) == list(range(1, 9))
    assert 0 not in got
    assert a.available_size() == 0
    assert a.free_slots() == set()


def test_allocator_alloc_zero_and_short():
    a = TokenToKVPoolAllocator(4)
    assert a.alloc(0) == []
    assert a.available_size() == 4
    first = a.alloc(3)
    assert first is not None and len(first) == 3
    assert a.alloc(2) is None  # not enough: nothing allocated
    assert a.available_size() == 1
    assert a.alloc(1) is not None
    assert a.alloc(1) is None
    with pytest.raises(ValueError):
        a.alloc(-1)


def test_allocator_free_and_reuse():
    a = TokenToKVPoolAllocator(5)
    got = a.alloc(3)
    assert got is not None
    assert len(set(got)) == 3
    a.free(got[:2])
    assert a.available_size() == 4
    assert a.free_slots() == set(range(1, 6)) - {got[2]}
    again = a.alloc(4)
    assert again is not None
    assert got[2] not in again
    assert set(again) | {got[2]} == set(range(1, 6))


def test_allocator_free_accepts_any_iterable():
    a = TokenToKVPoolAllocator(3, debug=True)
    got = a.alloc(3)
    assert got is not None
    a.free(s for s in got)
    assert a.free_slots() == {1, 2, 3}


def test_allocator_debug_double_free_and_range():
    a = TokenToKVPoolAllocator(4, debug=True)
    got = a.alloc(2)
    assert got is not None
    a.free(got)
    with pytest.raises(ValueError, match="double free"):
        a.free([got[0]])
    with pytest.raises(ValueError, match="out of range"):
        a.free([0])
    with pytest.raises(ValueError, match="out of range"):
        a.free([5])
    b = TokenToKVPoolAllocator(4, debug=True)
    s = b.alloc(1)
    assert s is not None
    with pytest.raises(ValueError, match="double free"):
        b.free([s[0], s[0]])


def test_allocator_no_debug_does_not_check():
    a = TokenToKVPoolAllocator(2)
    a.free([1])  # silently accepted without debug (speed)
    assert a.available_size() == 3


# ---- ReqToTokenPool ------------------------------------------------------------------------------


def test_req_pool_alloc_get_append_free():
    p = ReqToTokenPool(2)
    assert len(p) == 0 and p.available_size() == 2
    p.alloc("a", [1, 2, 3])
    assert "a" in p and "b" not in p
    assert p.get("a") == [1, 2, 3]
    p.append("a", [4])
    assert p.get("a") == [1, 2, 3, 4]
    assert len(p) == 1 and p.available_size() == 1
    assert p.free("a") == [1, 2, 3, 4]
    assert "a" not in p and len(p) == 0
    with pytest.raises(KeyError):
        p.get("a")


def test_req_pool_full_and_duplicate():
    p = ReqToTokenPool(1)
    p.alloc("a", [])
    with pytest.raises(ValueError):
        p.alloc("a", [1])
    with pytest.raises(RuntimeError):
        p.alloc("b", [1])


def test_req_pool_copies_input():
    p = ReqToTokenPool(1)
    src = [1, 2]
    p.alloc("a", src)
    src.append(3)
    assert p.get("a") == [1, 2]
