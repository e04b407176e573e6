import numpy as np
import pytest

from realtime_omni.gateway.media.playout import Playout, PlayoutFull


def test_read_gives_exactly_n_with_silence_after_the_end() -> None:
    p = Playout(24000)
    p.write("a", np.ones(300, np.float32), token_time=1.0)
    r = p.read(480)
    assert len(r.pcm) == 480 and r.pcm[:300].min() == 1 and r.pcm[300:].max() == 0
    assert r.items == [("a", 0, 300)]
    assert len(p.read(480).pcm) == 480 and p.queued == 0
    assert len(p.read(480, pad=False).pcm) == 0


def test_chunk_starts_carry_token_times_where_they_leave() -> None:
    p = Playout(24000)
    p.write("a", np.ones(500, np.float32), token_time=1.0)
    p.write("a", np.ones(500, np.float32), token_time=2.0)
    r1 = p.read(480)
    assert [(c.token_time, c.offset, c.queue_was_empty) for c in r1.chunk_starts] == [
        (1.0, 0, True)
    ]
    r2 = p.read(480)
    assert [(c.token_time, c.offset, c.queue_was_empty) for c in r2.chunk_starts] == [
        (2.0, 20, False)
    ]


def test_clear_silences_the_next_read_and_counts_what_was_played() -> None:
    p = Playout(24000)
    p.write("a", np.ones(2400, np.float32), token_time=1.0)
    p.read(480)
    assert p.clear() == 1920
    assert p.read(480).pcm.max() == 0
    assert p.played["a"] == 480 and p.played_ms("a") == 20 and p.queued == 0


def test_clear_one_item_keeps_the_others_and_items_are_split_in_a_read() -> None:
    p = Playout(8000)
    p.write("a", np.ones(100, np.float32))
    p.write("b", np.full(100, 0.5, np.float32))
    r = p.read(150)
    assert r.items == [("a", 0, 100), ("b", 100, 50)]
    p.write("c", np.ones(10, np.float32))
    assert p.clear("b") == 50
    assert p.queued == 10 and p.queued_of("c") == 10


def test_limit_is_enforced() -> None:
    p = Playout(8000, max_samples=100)
    p.write("a", np.ones(100, np.float32))
    with pytest.raises(PlayoutFull):
        p.write("a", np.ones(1, np.float32))
