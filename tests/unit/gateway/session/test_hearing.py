"""The audio waiting for the VAD is bounded: a minute appended at once is judged whole; a stream
the VAD falls behind holds a minute at most, the oldest skipped (session/hearing.py)."""

from __future__ import annotations

import asyncio

import numpy as np

from realtime_omni.gateway.session.hearing import MAX_PENDING_SAMPLES, Hearing
from realtime_omni.gateway.turns.vad import WINDOW_SAMPLES

RATE = 16000


class Vad:
    """Says 0.5 of every window; counts windows and resets."""

    def __init__(self) -> None:
        self.windows = 0
        self.resets = 0

    async def probs(self, windows: list[np.ndarray]) -> list[float]:
        self.windows += len(windows)
        return [0.5] * len(windows)

    def reset(self) -> None:
        self.resets += 1


async def judge_all(hearing: Hearing) -> int:
    return sum([len(part) async for part in hearing.judge()])


def test_a_minute_appended_at_once_is_judged_whole() -> None:
    vad = Vad()
    hearing = Hearing(vad)
    hearing.push(np.zeros(60 * RATE, np.float32), 60 * RATE, 0.0)
    assert asyncio.run(judge_all(hearing)) == 60 * RATE // WINDOW_SAMPLES
    assert hearing.skipped == 0 and vad.resets == 0


def test_a_stream_the_vad_falls_behind_holds_a_minute_and_skips_the_oldest() -> None:
    vad = Vad()
    hearing = Hearing(vad)
    end = 0
    for _ in range(90):  # 90 s in 1 s appends, none judged yet
        end += RATE
        hearing.push(np.zeros(RATE, np.float32), end, 0.0)
    assert hearing._pending_samples == MAX_PENDING_SAMPLES
    judged = asyncio.run(judge_all(hearing))
    assert judged == MAX_PENDING_SAMPLES // WINDOW_SAMPLES  # the newest minute
    assert hearing.skipped == 30 * RATE and vad.resets == 1
    assert hearing.judged == end  # the count of samples judged goes on where the input is
    end += 2 * WINDOW_SAMPLES
    hearing.push(np.zeros(2 * WINDOW_SAMPLES, np.float32), end, 0.0)
    assert asyncio.run(judge_all(hearing)) == 2 and hearing.judged == end
