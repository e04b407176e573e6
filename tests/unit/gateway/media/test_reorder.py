"""`media/reorder.py`: RTP sequence numbers back in order, a gap waited for only `wait_packets`
packets, on traces a lossy, reordering network makes."""

import random

import pytest

from realtime_omni.gateway.media.reorder import MAX_JUMP, Lost, Reorder


def feed(r: Reorder[int], seqs: list[int]) -> list[list[int | Lost]]:
    return [r.push(s, s) for s in seqs]


def test_packets_in_sequence_leave_at_once() -> None:
    assert feed(Reorder(2), [7, 8, 9]) == [[7], [8], [9]]


def test_a_gap_waits_for_wait_packets_then_is_lost_and_the_held_leave_in_order() -> None:
    r: Reorder[int] = Reorder(3)
    assert feed(r, [1, 3, 4, 5]) == [[1], [], [], [Lost(1), 3, 4, 5]]
    assert r.lost == 1 and not r.holding
    assert feed(Reorder(1), [1, 3]) == [[1], [Lost(1), 3]]  # 1: never wait


def test_a_late_packet_fills_its_gap_and_releases_what_waited() -> None:
    r: Reorder[int] = Reorder(3)
    assert feed(r, [1, 3, 4, 2, 5]) == [[1], [], [], [2, 3, 4], [5]]
    assert r.lost == r.late == 0


def test_too_late_or_twice_is_dropped() -> None:
    r: Reorder[int] = Reorder(2)
    assert feed(r, [1, 3, 4, 2, 4, 3]) == [[1], [], [Lost(1), 3, 4], [], [], []]
    assert (r.lost, r.late) == (1, 3)
    r = Reorder(3)
    assert feed(r, [1, 3, 3]) == [[1], [], []] and r.late == 1  # a duplicate while held


def test_each_gap_waits_for_packets_after_itself() -> None:
    r: Reorder[int] = Reorder(2)
    # 2 is given up when 3 and 5 are in; 4 has only 5 after it, and it comes
    assert feed(r, [1, 3, 5, 4]) == [[1], [], [Lost(1), 3], [4, 5]]


def test_sequence_numbers_wrap() -> None:
    r: Reorder[int] = Reorder(2)
    assert feed(r, [65534, 0, 65535, 1]) == [[65534], [], [65535, 0], [1]]


def test_a_jump_is_a_new_stream_not_a_loss() -> None:
    r: Reorder[int] = Reorder(3)
    far = 11 + MAX_JUMP  # 11 is due
    assert feed(r, [10, 12, far, far + 1]) == [[10], [], [Lost(1), 12, far], [far + 1]]
    assert r.lost == 1


def test_flush_gives_up_what_is_missing_when_the_sender_goes_quiet() -> None:
    r: Reorder[int] = Reorder(4)
    assert feed(r, [1, 3, 5]) == [[1], [], []]
    assert r.flush() == [Lost(1), 3, Lost(1), 5] and r.flush() == []
    assert feed(r, [6]) == [[6]]


@pytest.mark.parametrize("seed", range(5))
def test_a_lossy_reordering_link_loses_only_what_it_dropped_in_order(seed: int) -> None:
    """10 % loss and packets now and then one place late: every packet that arrives leaves once,
    in order; the gaps counted are exactly the dropped packets."""
    rng = random.Random(seed)
    sent = [(60000 + i) % 65536 for i in range(2000)]  # through the wrap
    kept = [s for s in sent if rng.random() > 0.1]
    i = 1
    while i < len(kept) - 1:
        if rng.random() < 0.05:  # this one overtakes the one before it
            kept[i], kept[i + 1] = kept[i + 1], kept[i]
            i += 1
        i += 1
    r: Reorder[int] = Reorder(3)
    out = [x for s in kept for x in r.push(s, s)] + r.flush()
    items = [x for x in out if not isinstance(x, Lost)]
    assert items == [s for s in sent if s in set(kept)]  # every one, in sending order
    # each Lost where its packets were: the sent sequence, the dropped ones as gaps
    timeline = [y for x in out for y in ([None] * x.packets if isinstance(x, Lost) else [x])]
    span = sent[sent.index(items[0]) : sent.index(items[-1]) + 1]
    assert timeline == [s if s in set(kept) else None for s in span]
    assert r.lost == timeline.count(None) and r.late == 0
