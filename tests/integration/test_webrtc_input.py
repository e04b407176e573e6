"""The caller's WebRTC audio reaches the session as each packet arrives (`webrtc_input.py`, in
place of aiortc's jitter buffer), over a real aiortc call on loopback, through a link that drops
and reorders packets on purpose: nothing is lost but what the link dropped, the order is the
caller's, and a packet in sequence is in the session before aiortc's receiver has returned."""

from __future__ import annotations

import asyncio

from realtime_omni.gateway.transports.webrtc_input import QUIET_S, CallerAudio
from tests.conftest import run, timeout
from tests.integration.rtp_link import LEAD_FRAMES, LEVELS, SLOT, Call, call

FRAMES = 120  # 2.4 s
DROP = {40, 41, 60, 95}  # packets, in the order sent: a burst of two, two single losses
LATE = {70, 80}  # each overtaken by the one after it


async def finished(c: Call, extra_s: float = 0.3) -> None:
    await asyncio.wait_for(c.sender.done.wait(), timeout(20))
    await asyncio.sleep(extra_s)


def expected_levels(frames: int, drop: set[int]) -> list[int | None]:
    """What the session should hear from the onset on, frame by frame."""
    return [
        None if i in drop else (i - LEAD_FRAMES) % len(LEVELS) for i in range(LEAD_FRAMES, frames)
    ]


def test_a_lossy_reordering_link_loses_only_the_dropped_packets_in_order() -> None:
    async def body() -> Call:
        async with call(FRAMES, wait_packets=2, drop=DROP, late=LATE) as c:
            await finished(c)
        return c

    c = run(body())
    audio = c.audio
    assert isinstance(audio, CallerAudio)
    assert audio.frames == FRAMES - len(DROP)  # every packet that came, once
    assert (audio.reorder.lost, audio.reorder.late) == (len(DROP), 0)
    assert audio.concealed_ms == 20 * len(DROP)  # each lost packet's 20 ms, as silence
    # The session's clock kept the caller's: as many samples as were sent (less the
    # resampler's own delay, a few samples), the lost frames as silence in their place.
    assert FRAMES * SLOT - SLOT // 4 <= c.heard.samples <= FRAMES * SLOT
    delay = FRAMES * SLOT - c.heard.samples  # the resampler's, in samples
    x = c.heard.audio()
    for first, n in ((40, 2), (60, 1), (95, 1)):  # each loss: silence in exactly its place
        gap = x[first * SLOT - delay : (first + n) * SLOT - delay]
        assert len(gap) == n * SLOT and not gap.any(), first
    # Read back by level, every frame is the one the caller sent there, the reordered ones
    # included; a lost frame's neighbours are the codec's to damage (their overlap with it).
    heard, want = c.heard.levels(), expected_levels(FRAMES, DROP)
    assert len(heard) >= len(want) - 1
    near_loss = {i + d for i in DROP for d in (-1, 0, 1)}
    for k, (got, sent) in enumerate(zip(heard, want, strict=False)):
        if k + LEAD_FRAMES not in near_loss:
            assert got == sent, (k + LEAD_FRAMES, heard, want)


def test_a_packet_in_sequence_is_heard_before_the_receiver_returns() -> None:
    """No buffering for packets in order: aiortc's own jitter buffer hands each on 4 packets
    (80 ms) later. A packet after a gap waits for the next one (wait_packets=2), no longer."""

    async def body() -> Call:
        async with call(FRAMES, wait_packets=2, drop=DROP, late=LATE) as c:
            await finished(c)
        return c

    c = run(body())
    waited = DROP | LATE | {i + 1 for i in DROP | LATE}
    for i in range(LEAD_FRAMES + 1, FRAMES - 1):
        heard_at = c.heard.time_when((i + 1) * SLOT - SLOT // 2)  # most of packet i
        assert heard_at is not None
        if i not in waited:
            assert heard_at <= c.link.handled[i], i
        elif i - 1 in DROP and i not in DROP:  # held for one packet: heard with the next
            assert heard_at <= c.link.handled[i + 1], i


def test_a_gap_before_the_caller_goes_quiet_is_given_up_after_quiet_s() -> None:
    """The last packets come after a loss and then nothing more: they are not held for a next
    packet that never comes."""

    async def body() -> tuple[Call, int]:
        async with call(30, wait_packets=4, drop={27}) as c:
            await finished(c, extra_s=0.0)
            held = c.heard.samples
            await asyncio.sleep(QUIET_S + timeout(0.3))
        return c, held

    c, held = run(body())
    assert held <= 27 * SLOT  # 28 and 29 wait for 27 (wait_packets=4: two more would do)
    assert c.heard.samples >= 30 * SLOT - SLOT // 4  # then went in, after the silence for 27
    assert c.audio.reorder.lost == 1
