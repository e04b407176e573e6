"""SlotPool: credits per edge, leases, per-request counts, reclaim of a dead peer's slots."""

from __future__ import annotations

import pytest

from realtime_omni.pipeline.slots import SlotPool


def test_acquire_until_exhausted() -> None:
    pool = SlotPool(3)
    leases = [pool.acquire("r1", "p#0") for _ in range(3)]
    assert sorted(pool.slot(x) for x in leases if x is not None) == [0, 1, 2]
    assert pool.free == 0
    assert pool.acquire("r2", "p#0") is None
    assert pool.free == 0
    assert pool.held("r2") == 0


def test_release_gives_the_request_and_frees_the_slot() -> None:
    pool = SlotPool(2)
    a = pool.acquire("r1", "p#0")
    b = pool.acquire("r2", "p#0")
    assert a is not None and b is not None
    assert pool.release(b) == "r2"
    assert pool.free == 1
    c = pool.acquire("r3", "p#0")
    assert c is not None and pool.slot(c) == pool.slot(b)  # the freed slot is lent again...
    assert c != b  # ...under a new lease
    assert pool.release(a) == "r1"


def test_the_last_slot_returned_is_lent_first() -> None:
    pool = SlotPool(3)
    a, b, c = (pool.acquire("r", "p#0") for _ in range(3))
    assert a is not None and b is not None and c is not None
    for x in (a, c, b):
        pool.release(x)
    again = pool.acquire("r", "p#0")
    assert again is not None and pool.slot(again) == pool.slot(b)  # its memory is warmest


def test_double_and_unknown_release() -> None:
    pool = SlotPool(2)
    s = pool.acquire("r1", "p#0")
    assert s is not None
    assert pool.release(s) == "r1"
    assert pool.release(s) is None
    assert pool.release(99) is None
    assert pool.release(-1) is None
    assert pool.free == 2
    # the duplicates did not put a slot in the free list twice
    again = [pool.acquire("r", "p#0"), pool.acquire("r", "p#0")]
    assert {pool.slot(x) for x in again if x is not None} == {0, 1}
    assert pool.acquire("r", "p#0") is None


def test_held_per_request() -> None:
    pool = SlotPool(4)
    s1 = pool.acquire("r1", "p#0")
    s2 = pool.acquire("r1", "q#0")
    pool.acquire("r2", "p#0")
    assert (pool.held("r1"), pool.held("r2"), pool.held("r3")) == (2, 1, 0)
    assert s1 is not None and s2 is not None
    pool.release(s1)
    assert pool.held("r1") == 1
    pool.release(s2)
    assert pool.held("r1") == 0
    assert pool.held("r2") == 1


def test_reclaim_takes_only_that_peers_slots() -> None:
    pool = SlotPool(5)
    pool.acquire("r1", "dead#0")
    keep = pool.acquire("r1", "live#0")
    pool.acquire("r2", "dead#0")
    pool.acquire("r3", "live#0")
    assert sorted(pool.reclaim("dead#0")) == ["r1", "r2"]
    assert pool.free == 3
    assert (pool.held("r1"), pool.held("r2"), pool.held("r3")) == (1, 0, 1)
    assert pool.reclaim("dead#0") == []
    assert pool.reclaim("nobody#0") == []
    assert keep is not None
    assert pool.release(keep) == "r1"  # the live peer's ack still counts


def test_late_ack_after_reclaim_is_ignored() -> None:
    pool = SlotPool(2)
    s = pool.acquire("r1", "dead#0")
    assert s is not None
    pool.reclaim("dead#0")
    other = pool.acquire("r2", "live#0")
    assert other is not None and pool.slot(other) == pool.slot(s)  # the same slot, lent again
    assert pool.release(s) is None  # the dead peer's late ack does not free it
    assert (pool.free, pool.held("r2")) == (1, 1)
    assert pool.release(other) == "r2"


@pytest.mark.parametrize("n", [0, -1])
def test_needs_a_slot(n: int) -> None:
    with pytest.raises(ValueError, match="at least one slot"):
        SlotPool(n)


def test_an_edge_lends_one_request_only_its_share() -> None:
    from realtime_omni.pipeline.graph import Edge
    from realtime_omni.pipeline.relay import Outlet

    out = Outlet(Edge("a", "b", "stream", "inline", 8, 1024, request_slots=2), "a#0", 0, 1, 0)
    got = [out.acquire("slow", "b#0") for _ in range(3)]
    assert got[2] is None and None not in got[:2]  # its share is 2 of the 8
    assert out.acquire("other", "b#0") is not None  # the others still get credit
    out.pool.release(got[0])
    assert out.acquire("slow", "b#0") is not None
