"""A minimal aiortc caller of the gateway, for tests, benchmarks and scripts.

    caller = Caller("http://127.0.0.1:8000", loopback=True)
    await caller.connect()                  # or connect(whip=True); offer, answer, data channel
    caller.mic.say(pcm_48k)                 # float32 48 kHz mono, sent in real time, then silence
    t, ev = await caller.wait_for("response.done", limit_s=15)
    caller.frames                           # (arrival monotonic s, peak |x|) per received frame
    await caller.hang_up()
    Caller(url, camera=Camera((220, 120, 30)))  # a video track too; set `.rgb` to change it

`espeak(text)` gives speech to send (espeak-ng, float32 mono at its own rate), None without it.

It does what a browser page does: an audio track (a camera's too, when given), the "oai-events"
data channel, an offer with every candidate (it waits for ICE gathering) posted to
`/v1/webrtc/offer` or `/v1/whip`.
`loopback=True` offers only 127.0.0.1 as a host candidate (process-wide, see `ice.py`).
"""

from __future__ import annotations

import asyncio
import fractions
import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
import wave
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioFrame, VideoFrame

from realtime_omni.aio import wait_set
from realtime_omni.gateway.transports.ice import LOOPBACK, use_host_addresses
from realtime_omni.gateway.transports.webrtc import EVENTS_LABEL
from realtime_omni.gateway.transports.webrtc_media import (
    FRAME_S,
    FRAME_SAMPLES,
    RATE_HZ,
    frame_to_mono,
)

VIDEO_CLOCK_HZ = 90000  # RTP's video clock


def _form(fields: dict[str, str]) -> tuple[bytes, str]:
    """A multipart/form-data body of text fields, and its Content-Type."""
    boundary = f"rto{uuid.uuid4().hex}"
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'
        for k, v in fields.items()
    ]
    body = "".join(parts) + f"--{boundary}--\r\n"
    return body.encode(), f"multipart/form-data; boundary={boundary}"


def http(
    method: str,
    url: str,
    body: bytes | None = None,
    content_type: str | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One blocking HTTP request: (status, headers with lower-case names, body), error statuses
    included."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    if content_type:
        req.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


class Microphone(MediaStreamTrack):
    """20 ms 48 kHz mono frames in real time: what `say` queued, then silence."""

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self._queue: deque[np.ndarray] = deque()  # int16 pieces, sent in order
        self._start: float | None = None
        self._frames = 0
        self.speech_ended_at: float | None = None  # when the last queued sample left

    def say(self, pcm: np.ndarray) -> None:
        x = np.clip(np.asarray(pcm, np.float32).reshape(-1), -1, 1)
        self._queue.append((x * 32767).astype(np.int16))

    @property
    def queued_s(self) -> float:
        return sum(len(p) for p in self._queue) / RATE_HZ

    async def recv(self) -> AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        if self._start is None:
            self._start = time.monotonic()
        wait = self._start + self._frames * FRAME_S - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        out = np.zeros(FRAME_SAMPLES, np.int16)
        got = 0
        while got < FRAME_SAMPLES and self._queue:
            piece = self._queue[0]
            n = min(FRAME_SAMPLES - got, len(piece))
            out[got : got + n] = piece[:n]
            got += n
            if n == len(piece):
                self._queue.popleft()
                if not self._queue:
                    self.speech_ended_at = time.monotonic()
            else:
                self._queue[0] = piece[n:]
        frame = AudioFrame.from_ndarray(out.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = RATE_HZ
        frame.pts = self._frames * FRAME_SAMPLES
        frame.time_base = fractions.Fraction(1, RATE_HZ)
        self._frames += 1
        return frame


class Camera(MediaStreamTrack):
    """`fps` generated frames a second in real time: `width` x `height` of one colour, `rgb`,
    which may be changed between frames."""

    kind = "video"

    def __init__(
        self, rgb: tuple[int, int, int], width: int = 320, height: int = 240, fps: float = 10.0
    ) -> None:
        super().__init__()
        self.rgb = rgb
        self.width, self.height, self.fps = width, height, fps
        self._start: float | None = None
        self._frames = 0

    async def recv(self) -> VideoFrame:
        if self.readyState != "live":
            raise MediaStreamError
        if self._start is None:
            self._start = time.monotonic()
        wait = self._start + self._frames / self.fps - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        image = np.empty((self.height, self.width, 3), np.uint8)
        image[:] = self.rgb
        frame = VideoFrame.from_ndarray(image, format="rgb24")
        frame.pts = round(self._frames * VIDEO_CLOCK_HZ / self.fps)
        frame.time_base = fractions.Fraction(1, VIDEO_CLOCK_HZ)
        self._frames += 1
        return frame


class Caller:
    """One call to the gateway at `base_url`; with `camera`, a video track too. With
    `listen=False` the caller drops the audio it receives on arrival instead of decoding it
    (a load generator: what the server sent is counted on the server)."""

    def __init__(
        self,
        base_url: str,
        loopback: bool = True,
        camera: MediaStreamTrack | None = None,
        listen: bool = True,
    ) -> None:
        if loopback:
            use_host_addresses([LOOPBACK])
        self.base_url = base_url.rstrip("/")
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.mic = Microphone()
        self.events: list[tuple[float, dict[str, Any]]] = []  # (arrival monotonic s, event)
        self.frames: list[tuple[float, float]] = []  # (arrival monotonic s, peak |x|)
        self.session_id: str | None = None
        self.location: str | None = None
        self.listen = listen
        self._got_event = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.channel = self.pc.createDataChannel(EVENTS_LABEL)
        self.channel.on("message", self._on_message)
        self.pc.on("track", self._on_track)
        self.pc.addTrack(self.mic)
        self.camera = camera
        if camera is not None:
            self.pc.addTrack(camera)

    def _on_message(self, raw: str | bytes) -> None:
        self.events.append((time.monotonic(), json.loads(raw)))
        self._got_event.set()

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio":
            self._tasks.append(asyncio.ensure_future(self._listen(track)))

    async def _listen(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            assert isinstance(frame, AudioFrame)
            self.frames.append((time.monotonic(), float(np.abs(frame_to_mono(frame)).max())))

    async def offer(self) -> str:
        """The local offer, every candidate in it."""
        await self.pc.setLocalDescription(await self.pc.createOffer())
        return self.pc.localDescription.sdp

    async def connect(
        self,
        whip: bool = False,
        limit_s: float = 10.0,
        calls: bool = False,
        token: str | None = None,
        session: dict[str, Any] | None = None,
        live: dict[str, Any] | None = None,
    ) -> None:
        """Offer, apply the answer, wait for the data channel to open. `calls`: OpenAI's flow,
        `POST /v1/realtime/calls` with `token` (a key or client secret) as the bearer, and
        `session` settings in a multipart form beside the offer. `live`: OpenAI's Live API,
        `POST /v1/live/sessions` with this startup configuration (`session.start`'s)."""
        sdp = await self.offer()
        auth = {"Authorization": f"Bearer {token}"} if token else {}
        if live is not None:
            start = json.dumps({"session": live, "transport": {"type": "webrtc", "sdp": sdp}})
            status, headers, reply = await asyncio.to_thread(
                http, "POST", f"{self.base_url}/v1/live/sessions", start.encode(),
                "application/json", auth,
            )  # fmt: skip
            if status != 201:
                raise RuntimeError(f"Live session refused: {status} {reply.decode()}")
            created = json.loads(reply)
            self.session_id, answer = created["session"]["id"], created["transport"]["sdp"]
        elif calls:
            if session is None:
                body, kind = sdp.encode(), "application/sdp"
            else:
                body, kind = _form({"sdp": sdp, "session": json.dumps(session)})
            status, headers, reply = await asyncio.to_thread(
                http, "POST", f"{self.base_url}/v1/realtime/calls", body, kind, auth
            )
            if status != 201:
                raise RuntimeError(f"call refused: {status} {reply.decode()}")
            self.location = headers["location"]
            self.session_id = self.location.rsplit("/", 1)[1]
            answer = reply.decode()
        elif whip:
            status, headers, body = await asyncio.to_thread(
                http, "POST", f"{self.base_url}/v1/whip", sdp.encode(), "application/sdp", auth
            )
            if status != 201:
                raise RuntimeError(f"WHIP offer refused: {status} {body.decode()}")
            self.location = headers["location"]
            self.session_id = self.location.rsplit("/", 1)[1]
            answer = body.decode()
        else:
            data = json.dumps({"sdp": sdp, "type": "offer"}).encode()
            status, _, body = await asyncio.to_thread(
                http, "POST", f"{self.base_url}/v1/webrtc/offer", data, "application/json", auth
            )
            if status != 200:
                raise RuntimeError(f"offer refused: {status} {body.decode()}")
            reply = json.loads(body)
            self.session_id, answer = reply["session_id"], reply["sdp"]
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
        if not self.listen:
            for t in self.pc.getTransceivers():
                if t.kind == "audio":
                    # aiortc's own switch for a receiver that takes nothing: RTP is dropped
                    # on arrival, before the jitter buffer and the Opus decoder thread.
                    t.receiver._enabled = False
        deadline = time.monotonic() + limit_s
        while self.channel.readyState != "open":
            if time.monotonic() > deadline:
                raise TimeoutError(f"the data channel did not open in {limit_s} s")
            await asyncio.sleep(0.01)

    def send(self, event: dict[str, Any]) -> None:
        self.channel.send(json.dumps(event))

    async def wait_for(
        self, kind: str, limit_s: float = 15.0, since: float = 0.0
    ) -> tuple[float, dict[str, Any]]:
        """The first event of type `kind` that arrived at or after monotonic time `since`."""
        deadline = time.monotonic() + limit_s
        while True:
            for t, ev in self.events:
                if t >= since and ev.get("type") == kind:
                    return t, ev
            left = deadline - time.monotonic()
            if left <= 0:
                seen = [ev.get("type") for _, ev in self.events[-20:]]
                raise TimeoutError(f"no {kind} within {limit_s} s; last events: {seen}")
            self._got_event.clear()
            await wait_set(self._got_event, left)

    async def hang_up(self) -> None:
        """DELETE the WHIP resource (when made by WHIP), close the peer connection."""
        if self.location is not None:
            await asyncio.to_thread(http, "DELETE", f"{self.base_url}{self.location}")
            self.location = None
        await self.pc.close()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def espeak(text: str) -> tuple[np.ndarray, int] | None:
    """`text` spoken by espeak-ng: (float32 mono samples, rate_hz), or None if not installed."""
    if shutil.which("espeak-ng") is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "speech.wav"
        subprocess.run(["espeak-ng", "-w", str(path), text], check=True)
        with wave.open(str(path)) as w:
            rate = w.getframerate()
            pcm = np.frombuffer(w.readframes(w.getnframes()), np.int16)
    return pcm.astype(np.float32) / 32768, rate
