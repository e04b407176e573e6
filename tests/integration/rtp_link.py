"""A caller and the server's side of a WebRTC call in one process, over loopback UDP, with a link
that misbehaves on purpose; what the server hears, timed. For `test_webrtc_input.py` and
`benchmarks/receive_path.py`.

    async with call(wait_packets=2, drop={30, 31}, late={50}) as c:   # None: aiortc's buffer
        await c.sender.done.wait()
    c.heard.levels(), c.heard.heard, c.link.arrived, c.audio.frames

The caller sends `frames` 20 ms Opus frames, paced in real time: by default silence, then a
1 kHz tone whose level steps through `LEVELS` frame by frame (`staircase`), so the order of what
arrives can be read back off the audio. The link sits between the server's DTLS transport
and its receiver (after SRTP, before aiortc's own checks): packet i (in the order sent, from 0)
in `drop` never arrives; one in `late` arrives after the packet that follows it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fractions
import time
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from aiortc import RTCPeerConnection, RTCRtpReceiver
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.rtp import RtpPacket
from av import AudioFrame

from realtime_omni.gateway.session.driver import Session
from realtime_omni.gateway.transports.ice import use_host_addresses
from realtime_omni.gateway.transports.webrtc_input import CallerAudio, listen

RATE_HZ, FRAME_SAMPLES = 48000, 960
INPUT_RATE_HZ, SLOT = 16000, 320  # what the session hears: 16 kHz, 320 samples a frame
LEAD_FRAMES = 10  # silence before the tone
LEVELS = np.array([0.08, 0.14, 0.2, 0.26, 0.32, 0.38, 0.44, 0.5])  # the tone's peak, by frame


def staircase(i: int) -> int | None:
    """Frame i's level (an index into `LEVELS`; None: silence): the default signal."""
    return None if i < LEAD_FRAMES else (i - LEAD_FRAMES) % len(LEVELS)


class LevelTrack(MediaStreamTrack):
    """`frames` frames of audio in real time, frame i a tone at `level(i)`, then the track ends
    (`done` is set)."""

    kind = "audio"

    def __init__(self, frames: int, level: Callable[[int], int | None] = staircase) -> None:
        super().__init__()
        self.frames, self.level, self.sent = frames, level, 0
        self.done = asyncio.Event()
        self._start: float | None = None
        t = np.arange(FRAME_SAMPLES) / RATE_HZ
        self._tone = np.sin(2 * np.pi * 1000 * t)

    async def recv(self) -> AudioFrame:
        if self.sent >= self.frames:
            self.done.set()
            self.stop()
            raise MediaStreamError
        if self._start is None:
            self._start = time.monotonic()
        await asyncio.sleep(max(0.0, self._start + self.sent * 0.02 - time.monotonic()))
        k = self.level(self.sent)
        x = np.zeros(FRAME_SAMPLES) if k is None else LEVELS[k] * self._tone
        frame = AudioFrame.from_ndarray(
            (x * 32767).astype(np.int16)[None], format="s16", layout="mono"
        )
        frame.sample_rate, frame.pts = RATE_HZ, self.sent * FRAME_SAMPLES
        frame.time_base = fractions.Fraction(1, RATE_HZ)
        self.sent += 1
        return frame


class LossyLink:
    """Wraps `receiver._handle_rtp_packet`; `arrived[i]`: when packet i reached the server
    (perf_counter s), dropped or not."""

    def __init__(self, receiver: RTCRtpReceiver, drop: set[int], late: set[int]) -> None:
        self.drop, self.late = drop, late
        self.arrived: dict[int, float] = {}
        self.handled: dict[int, float] = {}  # when the receiver's handler returned
        self._first: int | None = None
        self._held: list[tuple[int, RtpPacket, int]] = []
        self._handle = receiver._handle_rtp_packet
        receiver._handle_rtp_packet = self._on_packet  # type: ignore[method-assign]

    async def _on_packet(self, packet: RtpPacket, arrival_time_ms: int) -> None:
        if self._first is None:
            self._first = packet.sequence_number
        i = (packet.sequence_number - self._first) % 65536
        self.arrived[i] = time.perf_counter()
        if i in self.drop:
            return
        if i in self.late:
            self._held.append((i, packet, arrival_time_ms))
            return
        await self._deliver(i, packet, arrival_time_ms)
        held, self._held = self._held, []
        for j, p, t in held:  # it comes after the one that overtook it
            self.arrived[j] = time.perf_counter()
            await self._deliver(j, p, t)

    async def _deliver(self, i: int, packet: RtpPacket, arrival_time_ms: int) -> None:
        await self._handle(packet, arrival_time_ms)
        self.handled[i] = time.perf_counter()

    def index(self, seq: int) -> int:
        assert self._first is not None
        return (seq - self._first) % 65536


@dataclass
class Heard:
    """Stands in for the session: what `push_audio` got, and when (perf_counter s); `heard[i]`:
    (when, samples so far) of the first push of packet i's audio, as the hooks `call` puts on
    the receive path say which packet is being pushed (`packet`)."""

    chunks: list[np.ndarray] = field(default_factory=list)
    pushes: list[tuple[float, int]] = field(default_factory=list)  # (when, samples so far)
    heard: dict[int, tuple[float, int]] = field(default_factory=dict)
    packet: int | None = None

    def push_audio(self, pcm: np.ndarray, rate_hz: int) -> None:
        assert rate_hz == INPUT_RATE_HZ
        self.chunks.append(np.asarray(pcm, np.int16))
        self.pushes.append((time.perf_counter(), self.samples + len(pcm)))
        if self.packet is not None:
            self.heard.setdefault(self.packet, self.pushes[-1])

    @property
    def samples(self) -> int:
        return self.pushes[-1][1] if self.pushes else 0

    def audio(self) -> np.ndarray:
        return (
            np.concatenate(self.chunks).astype(np.float32) / 32768 if self.chunks else np.zeros(0)
        )

    def onset(self) -> int:
        """The sample where the tone starts (the first frame's level in its first period)."""
        loud = np.flatnonzero(np.abs(self.audio()) > LEVELS[0] / 2)
        assert len(loud), "no tone heard"
        return int(loud[0])

    def levels(self) -> list[int | None]:
        """Frame by frame from the onset: the index into `LEVELS` of the level heard in the
        frame's middle, None where it is silent. (The levels come back scaled by one gain: the
        decoder's stereo mixed down to mono.)"""
        x, start = self.audio(), self.onset()
        mids = [x[s + SLOT // 4 : s + 3 * SLOT // 4] for s in range(start, len(x) - SLOT + 1, SLOT)]
        peaks = np.array([np.sqrt(2 * np.mean(m**2)) for m in mids])
        scaled = LEVELS * peaks.max() / LEVELS[-1]
        return [None if p < scaled[0] / 2 else int(np.argmin(np.abs(scaled - p))) for p in peaks]

    def time_when(self, samples: int) -> float | None:
        """When the session had heard `samples` samples."""
        return next((t for t, n in self.pushes if n >= samples), None)


@dataclass
class Call:
    sender: LevelTrack
    heard: Heard
    link: Any = None  # LossyLink, once the track is announced
    audio: Any = None  # the receiver's buffer: webrtc_input.CallerAudio, or aiortc's own


def tag(c: Call, track: MediaStreamTrack) -> None:
    """Tell `c.heard` which packet's audio it is given: the packet `CallerAudio` decodes, or
    the frame aiortc's path took off the track (its pts counts samples from packet 0's)."""
    if isinstance(c.audio, CallerAudio):
        decode = c.audio._decode

        def decoding(packet: RtpPacket) -> None:
            c.heard.packet = c.link.index(packet.sequence_number)
            decode(packet)
            c.heard.packet = None

        c.audio._decode = decoding  # type: ignore[method-assign]
    else:
        recv = track.recv

        async def receiving() -> Any:
            frame = await recv()
            c.heard.packet = frame.pts // FRAME_SAMPLES
            return frame

        track.recv = receiving  # type: ignore[method-assign]


@contextlib.asynccontextmanager
async def call(
    frames: int,
    wait_packets: int | None,
    drop: Collection[int] = (),
    late: Collection[int] = (),
    level: Callable[[int], int | None] = staircase,
) -> AsyncIterator[Call]:
    """A call whose server side hears through `webrtc_input.listen(wait_packets)`, as the
    gateway's does; closed on the way out."""
    use_host_addresses(["127.0.0.1"])
    caller, server = RTCPeerConnection(), RTCPeerConnection()
    c = Call(LevelTrack(frames, level), Heard())
    tasks: list[asyncio.Task[None]] = []

    @server.on("track")
    def on_track(track: MediaStreamTrack) -> None:
        receiver = next(t.receiver for t in server.getTransceivers() if t.receiver.track is track)
        c.link = LossyLink(receiver, set(drop), set(late))
        heard = listen(track, receiver, cast(Session, c.heard), wait_packets)
        c.audio = receiver._RTCRtpReceiver__jitter_buffer  # type: ignore[attr-defined]
        tag(c, track)
        tasks.append(asyncio.ensure_future(heard))

    caller.addTrack(c.sender)
    try:
        await caller.setLocalDescription(await caller.createOffer())
        await server.setRemoteDescription(caller.localDescription)
        await server.setLocalDescription(await server.createAnswer())
        await caller.setRemoteDescription(server.localDescription)
        yield c
    finally:
        await caller.close()
        await server.close()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, MediaStreamError):
                await asyncio.wait_for(t, 5)
        use_host_addresses(None)
