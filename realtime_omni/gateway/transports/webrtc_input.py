"""The caller's WebRTC audio into the session as each RTP packet arrives.

    heard = listen(track, receiver, session, wait_packets=2)  # in the "track" handler, before RTP
    await heard                                               # until the caller's track ends

aiortc's receiver hands every audio packet to a jitter buffer that gives a frame to its decoder
thread only once four more frames follow it: every frame of the caller's reaches the VAD 80 ms
late, and after a lost packet it waits for 16 more, drops the four frames before the gap and
stays 15 frames (300 ms) behind for the rest of the call. That buffer is built for a listener's
even playout; the server's VAD wants each frame at once and in order. So `CallerAudio` takes
the buffer's place on the receiver (aiortc still checks, unwraps and counts each packet for its
RTCP reports first): packets are put back in order by `media.reorder.Reorder`, which waits for a
missing packet only until `wait_packets` later ones came, decoded with aiortc's own decoder in
the event loop (tens of microseconds a 20 ms frame: less than the hand-off to a thread and
back), resampled to 16 kHz and pushed. A lost packet becomes as much silence (at most
`MAX_CONCEAL_MS`), so the session's audio clock keeps the caller's.

`wait_packets=None` keeps aiortc's jitter buffer and decoder thread (`pump_audio` reads the
track), as does an aiortc without that buffer to replace (a warning says so).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
from aiortc import RTCRtpCodecParameters, RTCRtpReceiver
from aiortc.codecs import get_decoder
from aiortc.codecs.base import Decoder
from aiortc.jitterbuffer import JitterFrame
from aiortc.mediastreams import MediaStreamTrack
from aiortc.rtp import RtpPacket
from av import AudioFrame, AudioResampler

from realtime_omni.gateway.media.audio import INPUT_RATE_HZ
from realtime_omni.gateway.media.reorder import Lost, Reorder
from realtime_omni.gateway.session.driver import Session
from realtime_omni.gateway.transports.webrtc_media import pump_audio

log = logging.getLogger(__name__)

FRAME_MS = 20  # what a lost packet is taken to have held until a packet says otherwise
MAX_CONCEAL_MS = 1000  # silence put in for one gap, at most
QUIET_S = 0.2  # no packet this long while one is held: the sender paused, stop waiting
# RTCRtpReceiver's private names for its audio jitter buffer and its codecs by payload type
_BUFFER, _CODECS = "_RTCRtpReceiver__jitter_buffer", "_RTCRtpReceiver__codecs"


class CallerAudio:
    """Stands in for aiortc's `JitterBuffer` on one receiver: `add` is what the receiver calls
    for every packet, in the event loop. Counts: `frames` decoded, `concealed_ms` of silence
    put in for lost packets; `reorder.lost` / `.late` packets."""

    def __init__(
        self,
        session: Session,
        codec_of: Callable[[int], RTCRtpCodecParameters | None],
        wait_packets: int,
        on_packet: Callable[[], None] | None = None,
    ) -> None:
        self.session, self.codec_of, self.on_packet = session, codec_of, on_packet
        self.reorder: Reorder[RtpPacket] = Reorder(wait_packets)
        self.frames = 0
        self.concealed_ms = 0.0
        self.capacity = wait_packets  # the JitterBuffer attribute, should anything read it
        self._decoders: dict[int, Decoder] = {}  # by payload type
        self._resampler = AudioResampler(format="s16", layout="mono", rate=INPUT_RATE_HZ)
        self._frame_samples = FRAME_MS * INPUT_RATE_HZ // 1000  # the last frame's, at 16 kHz
        self._quiet: asyncio.TimerHandle | None = None
        self._failed = False

    @classmethod
    def attach(
        cls,
        receiver: RTCRtpReceiver,
        session: Session,
        wait_packets: int,
        on_packet: Callable[[], None] | None = None,
    ) -> CallerAudio | None:
        """Take the place of `receiver`'s jitter buffer (before its first packet: call it from
        the peer connection's "track" event); None where this aiortc has none to replace."""
        codecs = getattr(receiver, _CODECS, None)
        if not hasattr(receiver, _BUFFER) or not isinstance(codecs, dict):
            log.warning("aiortc's RTCRtpReceiver changed: caller audio goes through its buffer")
            return None
        audio = cls(session, codecs.get, wait_packets, on_packet)
        setattr(receiver, _BUFFER, audio)
        return audio

    def add(self, packet: RtpPacket) -> tuple[bool, None]:
        """A packet in (`JitterBuffer.add`'s contract: no picture loss, no frame for aiortc's
        decoder: the audio went to the session)."""
        if self.on_packet is not None:
            self.on_packet()
        self._take(self.reorder.push(packet.sequence_number, packet))
        if self.reorder.holding and self._quiet is None:
            self._quiet = asyncio.get_running_loop().call_later(QUIET_S, self._flush)
        elif not self.reorder.holding and self._quiet is not None:
            self._quiet.cancel()
            self._quiet = None
        return False, None

    def close(self) -> None:
        """The track ended (the call is ending): what is still held is dropped."""
        if self._quiet is not None:
            self._quiet.cancel()
            self._quiet = None
        self.reorder.held.clear()

    def _flush(self) -> None:
        if self._quiet is not None:
            self._quiet.cancel()
            self._quiet = None
        self._take(self.reorder.flush())

    def _take(self, items: list[RtpPacket | Lost]) -> None:
        for item in items:
            if isinstance(item, Lost):
                n = min(item.packets * self._frame_samples, MAX_CONCEAL_MS * INPUT_RATE_HZ // 1000)
                self.concealed_ms += n * 1000 / INPUT_RATE_HZ
                self.session.push_audio(np.zeros(n, np.int16), INPUT_RATE_HZ)
            else:
                self._decode(item)

    def _decode(self, packet: RtpPacket) -> None:
        decoder = self._decoders.get(packet.payload_type)
        if decoder is None:
            codec = self.codec_of(packet.payload_type)
            if codec is None:  # aiortc checked it; kept for a receiver that did not
                return
            decoder = self._decoders[packet.payload_type] = get_decoder(codec)
        try:
            frames = decoder.decode(JitterFrame(packet._data, packet.timestamp))  # type: ignore[attr-defined]
        except Exception as e:  # a corrupt payload (av.FFmpegError and kin): this frame only
            if not self._failed:
                log.warning("a caller's audio frame did not decode (%s); later ones may", e)
                self._failed = True
            return
        for frame in frames:
            if not isinstance(frame, AudioFrame):
                continue
            self.frames += 1
            self._frame_samples = frame.samples * INPUT_RATE_HZ // frame.sample_rate
            for f in self._resampler.resample(frame):
                self.session.push_audio(f.to_ndarray().reshape(-1), INPUT_RATE_HZ)


def listen(
    track: MediaStreamTrack,
    receiver: RTCRtpReceiver | None,
    session: Session,
    wait_packets: int | None,
    on_packet: Callable[[], None] | None = None,
) -> Coroutine[Any, Any, None]:
    """Hear the caller's audio `track` (its `receiver`'s) into `session`: replaces the jitter
    buffer now, when `wait_packets` is set; the coroutine returned runs until the track ends."""
    audio = None
    if receiver is not None and wait_packets is not None:
        audio = CallerAudio.attach(receiver, session, wait_packets, on_packet)
    return _hear(track, session, on_packet, audio)


async def _hear(
    track: MediaStreamTrack,
    session: Session,
    on_packet: Callable[[], None] | None,
    audio: CallerAudio | None,
) -> None:
    try:  # with `audio` attached, the track only ever says it ended
        await pump_audio(track, session, on_packet)
    finally:
        if audio is not None:
            audio.close()
