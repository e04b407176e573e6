"""The WebRTC playout track's packets: silence leaves as Opus's silent frame without an encode,
the audio through one CELT encoder kept in step with the decoder, every packet on the sample
clock."""

import asyncio

import numpy as np
from av import Packet
from av.codec import CodecContext

from realtime_omni.gateway.session.driver import Session
from realtime_omni.gateway.transports.webrtc_media import (
    PLAYOUT_FRAME_SAMPLES,
    SILENT_OPUS,
    PlayoutTrack,
)
from tests.conftest import run
from tests.unit.gateway.fakes import FakeCoord


def test_silence_is_sent_as_the_silent_frame_and_speech_is_encoded() -> None:
    async def main() -> list[Packet]:
        s = Session(FakeCoord(), output_rate_hz=24000)
        track = PlayoutTrack(s)
        t = np.arange(PLAYOUT_FRAME_SAMPLES * 5) / 24000
        tone = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
        packets = [await track.recv() for _ in range(3)]  # nothing to say yet
        s.playout.write("item", tone)
        packets += [await track.recv() for _ in range(9)]  # 5 frames of a tone, then silence
        s.playout.write("item2", tone)
        packets += [await track.recv() for _ in range(5)]  # the tone again
        track.stop()
        return packets

    packets = run(asyncio.wait_for(main(), 10))
    data = [bytes(p) for p in packets]
    silent = [0, 1, 2, 10, 11]  # 8 and 9: the encoder's tail, then silence it coded itself
    assert [data[i] for i in silent] == [SILENT_OPUS] * len(silent)
    speech = [*range(3, 8), *range(12, 17)]
    assert all(data[i] != SILENT_OPUS and len(data[i]) > 10 for i in speech)
    # Speech is CELT alone (configurations 16-31 of the TOC byte), a third of SILK's CPU.
    assert all(data[i][0] >> 3 >= 16 for i in speech), [d[0] >> 3 for d in data]
    assert [p.pts for p in packets] == [i * PLAYOUT_FRAME_SAMPLES for i in range(17)]
    dec = CodecContext.create("opus", "r")
    dec.sample_rate, dec.layout = 48000, "stereo"
    levels = []
    for p in packets:
        (frame,) = dec.decode(Packet(bytes(p)))
        levels.append(float(np.abs(frame.to_ndarray()).max()))
    assert max(levels[:3]) == 0 and levels[10] < 0.01 and levels[11] == 0  # 10: 9's overlap
    # The 0.3 tone decodes as a tone from its first frame, after silence as at the start: the
    # encoder's energies follow the decoder's (a fresh encoder after silence faded in over
    # 100 ms, 0.01 to 0.25).
    assert min(levels[i] for i in speech) > 0.25, [round(x, 3) for x in levels]
