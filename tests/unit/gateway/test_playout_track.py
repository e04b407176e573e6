"""The WebRTC playout track's packets: silence leaves as Opus's silent frame without an encode,
the audio after it through a fresh encoder, every packet on the sample clock."""

import asyncio

import numpy as np
from av import Packet
from av.codec import CodecContext

from realtime_omni.gateway.session import Session
from realtime_omni.gateway.transports.webrtc_media import (
    PLAYOUT_FRAME_SAMPLES,
    SILENT_OPUS,
    PlayoutTrack,
)
from tests.conftest import run
from tests.unit.gateway.test_session import FakeCoord


def test_silence_is_sent_as_the_silent_frame_and_speech_is_encoded() -> None:
    async def main() -> list[Packet]:
        s = Session(FakeCoord(), output_rate_hz=24000)
        track = PlayoutTrack(s)
        packets = [await track.recv() for _ in range(3)]  # nothing to say yet
        t = np.arange(PLAYOUT_FRAME_SAMPLES * 5) / 24000
        s.playout.write("item", (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32))
        packets += [await track.recv() for _ in range(7)]  # 5 frames of a tone, then silence
        track.stop()
        return packets

    packets = run(asyncio.wait_for(main(), 10))
    data = [bytes(p) for p in packets]
    assert data[:3] == [SILENT_OPUS] * 3 and data[8:] == [SILENT_OPUS] * 2
    assert all(d != SILENT_OPUS and len(d) > 10 for d in data[3:8])
    assert [p.pts for p in packets] == [i * PLAYOUT_FRAME_SAMPLES for i in range(10)]
    dec = CodecContext.create("opus", "r")
    dec.sample_rate, dec.layout = 48000, "stereo"
    levels = []
    for p in packets:
        (frame,) = dec.decode(Packet(bytes(p)))
        levels.append(float(np.abs(frame.to_ndarray()).max()))
    assert max(levels[:3]) == 0 and min(levels[4:8]) > 0.2  # the 0.3 tone decodes as a tone
