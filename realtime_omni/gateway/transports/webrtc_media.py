"""The media of a WebRTC call: the session's voice out as a paced track, the person's audio and
camera in.

    track = PlayoutTrack(session, on_event)   # pc.addTrack(track); aiortc calls recv() per frame
    await pump_audio(remote_audio, session)   # until the remote track ends
    await pump_video(remote_video, session)   # latest frame only, at most `VIDEO_FPS` converted

`PlayoutTrack.recv` returns 20 ms of `Session.read_output` at the vocoder's 24 kHz, already
encoded as one mono Opus packet, packet `i` due at `start + i * 20 ms` on the monotonic clock
(pts `i * 480`: a sample counter, so the schedule never drifts). The track encodes itself, in the
event loop, rather than hand aiortc raw frames (a thread hand-off, a resampling to 48 kHz stereo
and a stereo encode per frame, twice the CPU). A silent frame is not encoded: it leaves as Opus's
3-byte silent CELT frame (libopus's own coding of digital silence is its costliest frame, and
most frames of most calls are silence). Speech is coded by CELT alone ("lowdelay"). One encoder
serves the whole call, kept in step with the decoder across the silent frames (`_encode`): CELT
predicts each frame's band energies from the last one's, so a fresh encoder after silence would
fade every answer in. The measurements behind each choice: `benchmarks/README.md`, "Figures
behind the gateway's code".

The read happens right before the frame is handed to aiortc, so the session's
`token_to_audio_ms` and `barge_in_to_silence_ms` time the frame leaving. A frame waits for its
due time, with one exception: once the queue has run dry (silence is leaving, or the last frame
took the last queued sample), a frame's worth of audio written wakes the track and the frame
leaves at once, up to one frame early, so new audio does not wait out the rest of a frame
period: neither an answer's first frame nor a chunk that comes just after the previous one ran
out. The RTP timestamps stay on the sample clock; the listener's jitter buffer absorbs a frame
arriving early. A barge-in flushes the queue; the next frame to leave, at most one frame period
later, is silence.
"""

from __future__ import annotations

import asyncio
import fractions
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioFrame, AudioResampler, Packet, VideoFrame
from av.audio.codeccontext import AudioCodecContext
from av.codec import CodecContext

from realtime_omni.aio import wait_set
from realtime_omni.gateway.media.audio import INPUT_RATE_HZ, MODEL_RATE_HZ, float_to_int16
from realtime_omni.gateway.session.driver import Session

log = logging.getLogger(__name__)

RATE_HZ = 48000  # Opus on the wire
FRAME_SAMPLES = 960  # 20 ms
FRAME_S = FRAME_SAMPLES / RATE_HZ
# The session's playout and the track run at the vocoder's rate: no resampling of the answer in
# the event loop.
PLAYOUT_RATE_HZ = MODEL_RATE_HZ
PLAYOUT_FRAME_SAMPLES = round(FRAME_S * PLAYOUT_RATE_HZ)
OPUS_BIT_RATE = 48000  # mono speech at 24 kHz; the SDP's opus/48000/2 decoders take mono too
MAX_BEHIND_S = 0.2  # further behind the schedule than this (a stalled loop), start it anew
SILENT_OPUS = b"\xf8\xff\xfe"  # one 20 ms CELT frame that decodes to silence (TOC 0xF8)
TAIL_FRAMES = 2  # after audio, frames of silence encoded: the look-ahead's tail, then silence
VIDEO_FPS = 2.0  # camera frames converted per second; the rest are dropped undecoded-to-RGB
MAX_VIDEO_SIDE = 1280  # camera frames are scaled down to this before they reach the session
_LOG_LEN = 1000  # counted chunk starts kept per track


class PlayoutTrack(MediaStreamTrack):
    """The session's audio out, paced in real time; silence when there is nothing to say.

    `frames`, `frames_late` (left more than one frame period after the due time) and `resyncs`
    count what left; `chunk_log` keeps (token_time, left_at) of every chunk start the session
    counts for token-to-audio (an answer's first, or one that found the queue empty).
    `on_event` gets `output_audio_buffer.started` / `.stopped` as an answer's audio begins and
    ends on the wire (OpenAI's WebRTC events)."""

    kind = "audio"

    def __init__(
        self, session: Session, on_event: Callable[[dict[str, Any]], None] | None = None
    ) -> None:
        super().__init__()
        self.session = session
        self.on_event = on_event
        self.frames = 0  # frames handed to aiortc (the pts counts their samples)
        self.frames_late = 0
        self.resyncs = 0
        self.chunk_log: deque[tuple[float, float]] = deque(maxlen=_LOG_LEN)
        self.lateness_ms: deque[float] = deque(maxlen=_LOG_LEN)  # left - due, recent frames
        self._start: float | None = None
        self._dry = True  # the queue was empty when the last frame left
        self._playing: tuple[str, str | None] | None = None  # (item_id, response_id) on the wire
        self._time_base = fractions.Fraction(1, PLAYOUT_RATE_HZ)
        self._opus: AudioCodecContext | None = None  # made at the first audio (`_encode`)
        self._tail = 0  # silent frames still to go through the encoder after audio

    async def recv(self) -> Packet:
        if self.readyState != "live":
            raise MediaStreamError
        if self._start is None:
            self._start = time.monotonic()
        due = self._start + self.frames * FRAME_S
        if time.monotonic() - due > MAX_BEHIND_S:  # a burst of stale frames helps no listener
            self.resyncs += 1
            self._start += time.monotonic() - due
            due = self._start + self.frames * FRAME_S
        await self._wait(due)
        if self.readyState != "live":
            raise MediaStreamError
        r = self.session.read_output(PLAYOUT_FRAME_SAMPLES)
        left = time.monotonic()
        self.lateness_ms.append((left - due) * 1e3)
        if left - due > FRAME_S:
            self.frames_late += 1
        for cs in r.chunk_starts:
            if cs.queue_was_empty:
                self.chunk_log.append((cs.token_time, left))
        pts = self.frames * PLAYOUT_FRAME_SAMPLES
        pcm16 = None
        if r.items:  # else the read was padding alone: digital silence
            pcm16 = float_to_int16(r.pcm).reshape(1, -1)
        if pcm16 is not None and pcm16.any():
            packet = self._encode(pcm16, pts)
            self._tail = TAIL_FRAMES
        elif self._tail:  # the encoder's look-ahead, then silence it has made itself
            self._tail -= 1
            packet = self._encode(np.zeros((1, PLAYOUT_FRAME_SAMPLES), np.int16), pts)
        else:
            packet = Packet(SILENT_OPUS)
            packet.time_base = self._time_base
        packet.pts = pts  # libopus's 2.5 ms look-ahead would shift only its own
        self.frames += 1
        self._dry = self.session.playout.queued == 0
        self._note_playing(r.items[0][0] if r.items else None)
        return packet

    def _encode(self, pcm16: np.ndarray, pts: int) -> Packet:
        """One Opus packet for 20 ms of s16 samples [1, n]. The encoder lives as long as the
        track: CELT codes each frame's band energies against the last frame's, so an encoder
        and a decoder must have seen the same frames. Between answers the decoder hears the
        silent frame, whose energies an encoder that coded a frame of silence itself shares
        (the tail frames after speech; a new encoder codes one first, and drops it)."""
        if self._opus is None:
            self._opus = _opus_encoder()
            self._opus.encode(self._frame(np.zeros_like(pcm16), pts))
        (packet,) = self._opus.encode(self._frame(pcm16, pts))  # one packet per frame
        return packet

    def _frame(self, pcm16: np.ndarray, pts: int) -> AudioFrame:
        frame = AudioFrame.from_ndarray(pcm16, format="s16", layout="mono")
        frame.sample_rate = PLAYOUT_RATE_HZ
        frame.pts = pts
        frame.time_base = self._time_base
        return frame

    async def _wait(self, due: float) -> None:
        s = self.session
        while (now := time.monotonic()) < due:
            if not self._dry or now < due - FRAME_S:
                await asyncio.sleep(due - now if not self._dry else due - FRAME_S - now)
                continue
            if s.playout.queued >= PLAYOUT_FRAME_SAMPLES:  # new audio on a dry queue: go now
                return
            s.audio_written.clear()
            await wait_set(s.audio_written, due - now)

    def _note_playing(self, item_id: str | None) -> None:
        playing = self._playing
        if item_id is not None and (playing is None or playing[0] != item_id):
            if playing is not None:
                self._event("output_audio_buffer.stopped", playing[1])
            self._playing = (item_id, self.session.response_of(item_id))
            self._event("output_audio_buffer.started", self._playing[1])
        elif item_id is None and playing is not None and not self.session.response_of(playing[0]):
            self._playing = None  # silence, and its response is over
            self._event("output_audio_buffer.stopped", playing[1])

    def _event(self, kind: str, response_id: str | None) -> None:
        if self.on_event is not None:
            self.on_event({"type": kind, "response_id": response_id})


def _opus_encoder() -> AudioCodecContext:
    c = CodecContext.create("libopus", "w")
    c.sample_rate = PLAYOUT_RATE_HZ  # libopus takes 24 kHz as it is; RTP still counts 48 kHz
    c.layout = "mono"
    c.format = "s16"
    c.bit_rate = OPUS_BIT_RATE
    # CELT alone ("lowdelay", OPUS_APPLICATION_RESTRICTED_LOWDELAY): a third of the CPU of
    # "voip", whose SILK analysis cost ~300 us a frame of speech here against ~110 us (libopus
    # through PyAV, 48 kbps, same bytes per frame), and 2.5 ms of look-ahead instead of 6.5. At
    # 48 kbps CELT carries speech as well as SILK; every Opus decoder takes either. With 16
    # answers playing at once the encodes were a third of the event loop's time.
    c.options = {"application": "lowdelay"}
    c.time_base = fractions.Fraction(1, PLAYOUT_RATE_HZ)
    return c


def frame_to_mono(frame: AudioFrame) -> np.ndarray:
    """A decoded frame (packed or planar, int or float samples) as mono float32 in [-1, 1]."""
    x: np.ndarray = frame.to_ndarray()
    channels = len(frame.layout.channels)
    if frame.format.is_planar:
        x = x.reshape(channels, -1)
        mono = x.mean(axis=0) if channels > 1 else x[0]
    else:
        x = x.reshape(-1, channels)
        mono = x.mean(axis=1) if channels > 1 else x[:, 0]
    if np.issubdtype(x.dtype, np.integer):
        return (mono / float(-np.iinfo(x.dtype).min)).astype(np.float32)
    return mono.astype(np.float32)


async def pump_audio(
    track: MediaStreamTrack, session: Session, on_frame: Callable[[], None] | None = None
) -> None:
    """Feed the remote audio track into the session until the track ends; `on_frame` is called
    as each frame arrives.

    libswresample (C) mixes the decoded 48 kHz stereo down to 16 kHz mono, the session's input
    rate, so the event loop does no per-sample work: a numpy resampler per call cost a fifth of
    the loop with four calls on two cores."""
    to_input = AudioResampler(format="s16", layout="mono", rate=INPUT_RATE_HZ)
    while True:
        try:
            frame = await track.recv()
        except MediaStreamError:
            return
        if on_frame is not None:
            on_frame()
        if isinstance(frame, AudioFrame):
            for f in to_input.resample(frame):
                session.push_audio(f.to_ndarray().reshape(-1), INPUT_RATE_HZ)


async def pump_video(track: MediaStreamTrack, session: Session, fps: float = VIDEO_FPS) -> None:
    """Keep the session's video frame the latest camera frame, converted at most `fps` times a
    second; every frame is still taken off the track (aiortc queues them without limit). When
    the track ends (the camera is off) turns carry no image any more."""
    last = -math.inf
    while True:
        try:
            frame = await track.recv()
        except MediaStreamError:
            session.set_video_frame(None)
            return
        now = time.monotonic()
        if not isinstance(frame, VideoFrame) or now - last < 1.0 / fps:
            continue
        last = now
        scale = min(1.0, MAX_VIDEO_SIDE / max(frame.width, frame.height, 1))
        width = max(2, int(frame.width * scale) // 2 * 2)
        height = max(2, int(frame.height * scale) // 2 * 2)
        rgb = frame.reformat(width=width, height=height, format="rgb24").to_ndarray()
        session.set_video_frame(rgb)
