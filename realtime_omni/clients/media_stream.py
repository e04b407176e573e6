"""A scripted phone provider: what Twilio, Telnyx or Plivo do on a call's media stream, for
tests and benchmarks.

    call = ProviderCall("ws://127.0.0.1:8000", "twilio", parameters={"instructions": "Be brief"})
    await call.connect()               # connected + start (the provider's own names and shapes)
    call.say(pcm_8k)                   # float32 8 kHz, sent as 20 ms mu-law media in real time
    await call.wait_media(limit_s=10)  # the first frame the server sent
    call.played                        # (time, peak) per 20 ms frame the "caller" heard
    call.clears                        # when the server's clear came
    await call.hang_up()               # stop, close

With `auth_token` (the account's) the upgrade is signed as the provider signs it: Twilio's
X-Twilio-Signature, Plivo's X-Plivo-Signature-V3; Telnyx signs none.

Like a provider it buffers what the server sends and plays it at 8 kHz after a jitter delay
(`delay_ms`), echoes each mark once the audio before it has played, and on a clear drops its
buffer and echoes every mark still pending (Twilio's documented behaviour; Plivo answers
`clearedAudio`). Silence is sent while nothing is being said, as a phone line does.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import uuid
from collections import deque
from typing import Any

import numpy as np
import websockets

from realtime_omni.gateway.media.audio import ulaw_decode, ulaw_encode
from realtime_omni.gateway.transports.signatures import plivo_signature, twilio_signature

RATE_HZ = 8000
FRAME = 160  # 20 ms
FRAME_S = 0.02


class ProviderCall:
    def __init__(
        self,
        url: str,
        provider: str = "twilio",
        parameters: dict[str, str] | None = None,
        delay_ms: float = 200.0,
        auth_token: str | None = None,
    ) -> None:
        base = url.replace("http://", "ws://").replace("https://", "wss://").rstrip("/")
        self.url = f"{base}/v1/phone/{provider}"
        self.provider = provider
        self.parameters = parameters or {}
        self.delay_s = delay_ms / 1000
        self.auth_token = auth_token
        self.stream_id = ("MZ" if provider == "twilio" else "") + uuid.uuid4().hex
        self.call_id = ("CA" if provider == "twilio" else "v3:") + uuid.uuid4().hex
        self.ws: Any = None
        self._mic: deque[tuple[np.ndarray, int]] = deque()  # (frame, utterance index)
        self.utterances: list[list[float]] = []  # [first frame sent, last frame sent] per say
        self._buffer: deque[np.ndarray | str] = deque()  # audio frames and mark names, in order
        self._buffered = 0  # samples in _buffer
        self._play_from = 0.0  # the jitter delay: nothing plays before this
        self.received: list[tuple[float, int]] = []  # (arrival, samples) per media message
        self.played: list[tuple[float, float]] = []  # (time, peak) per 20 ms frame heard
        self.played_samples = 0  # audio the caller heard (not silence padding)
        self.clears: list[float] = []
        self.marks_echoed = 0
        self.closed = asyncio.Event()  # the server closed the stream
        self._seq = 0
        self._tasks: list[asyncio.Task[Any]] = []

    # ---- the provider's messages ---------------------------------------------------------

    def _next(self) -> str:
        self._seq += 1
        return str(self._seq)

    def _start(self) -> dict[str, Any]:
        if self.provider == "telnyx":
            return {
                "event": "start",
                "sequence_number": self._next(),
                "stream_id": self.stream_id,
                "start": {
                    "call_control_id": self.call_id,
                    "media_format": {"encoding": "PCMU", "sample_rate": RATE_HZ, "channels": 1},
                    "custom_parameters": self.parameters,
                },
            }
        if self.provider == "plivo":
            headers = ",".join(f"{k}={v}" for k, v in self.parameters.items())
            return {
                "event": "start",
                "sequenceNumber": int(self._next()),
                "start": {
                    "callId": self.call_id,
                    "streamId": self.stream_id,
                    "tracks": ["inbound"],
                    "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": RATE_HZ},
                    "extra_headers": headers,
                },
            }
        return {
            "event": "start",
            "sequenceNumber": self._next(),
            "streamSid": self.stream_id,
            "start": {
                "accountSid": "AC" + "0" * 32,
                "streamSid": self.stream_id,
                "callSid": self.call_id,
                "tracks": ["inbound"],
                "customParameters": self.parameters,
                "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": RATE_HZ, "channels": 1},
            },
        }

    def _ids(self) -> dict[str, Any]:
        key = {"twilio": "streamSid", "telnyx": "stream_id", "plivo": "streamId"}[self.provider]
        seq = "sequence_number" if self.provider == "telnyx" else "sequenceNumber"
        return {seq: self._next(), key: self.stream_id}

    def media_message(self, payload: bytes, chunk: int) -> dict[str, Any]:
        media = {"track": "inbound", "chunk": str(chunk), "timestamp": str(chunk * 20)}
        media["payload"] = base64.b64encode(payload).decode()
        return {"event": "media", **self._ids(), "media": media}

    def _mark_echo(self, name: str) -> dict[str, Any]:
        if self.provider == "plivo":
            return {"event": "playedStream", **self._ids(), "name": name}
        return {"event": "mark", **self._ids(), "mark": {"name": name}}

    def dtmf_message(self, digit: str) -> dict[str, Any]:
        return {"event": "dtmf", **self._ids(), "dtmf": {"track": "inbound_track", "digit": digit}}

    # ---- the call --------------------------------------------------------------------------

    def signature_headers(self) -> dict[str, str]:
        """The upgrade's signature headers (none without `auth_token`, and none for Telnyx)."""
        if self.auth_token is None:
            return {}
        if self.provider == "twilio":
            return {"X-Twilio-Signature": twilio_signature(self.auth_token, self.url, {})}
        if self.provider == "plivo":
            nonce = uuid.uuid4().hex
            return {
                "X-Plivo-Signature-V3": plivo_signature(self.auth_token, self.url, nonce),
                "X-Plivo-Signature-V3-Nonce": nonce,
            }
        return {}

    async def connect(self) -> None:
        """Open the stream (`websockets.InvalidStatus` when the server refuses the upgrade),
        then send what the provider sends first."""
        self.ws = await websockets.connect(
            self.url, max_size=None, additional_headers=self.signature_headers()
        )
        if self.provider != "plivo":
            connected = {"event": "connected", "version": "1.0.0"}
            if self.provider == "twilio":
                connected["protocol"] = "Call"
            await self.send(connected)
        await self.send(self._start())
        self._tasks = [
            asyncio.create_task(self._mic_loop()),
            asyncio.create_task(self._receive_loop()),
            asyncio.create_task(self._play_loop()),
        ]

    async def send(self, msg: dict[str, Any] | str) -> None:
        await self.ws.send(msg if isinstance(msg, str) else json.dumps(msg))

    def say(self, pcm: np.ndarray) -> None:
        """Queue float32 8 kHz speech; it leaves in 20 ms frames in real time."""
        x = np.asarray(pcm, np.float32).reshape(-1)
        self.utterances.append([])
        for i in range(0, len(x), FRAME):
            f = x[i : i + FRAME]
            self._mic.append((np.pad(f, (0, FRAME - len(f))), len(self.utterances) - 1))

    @property
    def saying(self) -> bool:
        return bool(self._mic)

    async def _mic_loop(self) -> None:
        chunk, t = 0, time.monotonic()
        silence = np.zeros(FRAME, np.float32)
        while True:
            f, said = self._mic.popleft() if self._mic else (silence, -1)
            chunk += 1
            await self.send(self.media_message(ulaw_encode(f), chunk))
            if said >= 0:  # when this utterance's first and (so far) last frame left
                u = self.utterances[said]
                u[:] = [u[0] if u else time.monotonic(), time.monotonic()]
            t += FRAME_S
            await asyncio.sleep(max(0.0, t - time.monotonic()))

    async def _receive_loop(self) -> None:
        try:
            async for raw in self.ws:
                msg = json.loads(raw)
                kind = msg.get("event")
                if kind in ("media", "playAudio"):
                    pcm = ulaw_decode(base64.b64decode(msg["media"]["payload"]))
                    if not self._buffered:
                        self._play_from = time.monotonic() + self.delay_s
                    self._buffer.append(pcm)
                    self._buffered += len(pcm)
                    self.received.append((time.monotonic(), len(pcm)))
                elif kind in ("mark", "checkpoint"):
                    name = msg["mark"]["name"] if kind == "mark" else msg["name"]
                    if self._buffered:
                        self._buffer.append(name)
                    else:
                        await self._echo(name)
                elif kind in ("clear", "clearAudio"):
                    self.clears.append(time.monotonic())
                    pending = [x for x in self._buffer if isinstance(x, str)]
                    self._buffer.clear()
                    self._buffered = 0
                    if self.provider == "plivo":
                        await self.send({"event": "clearedAudio", **self._ids()})
                    else:
                        for name in pending:
                            await self._echo(name)
        except websockets.ConnectionClosed:
            pass
        finally:
            self.closed.set()

    async def _echo(self, name: str) -> None:
        self.marks_echoed += 1
        with contextlib.suppress(websockets.ConnectionClosed):
            await self.send(self._mark_echo(name))

    async def _play_loop(self) -> None:
        """The caller's earpiece: 20 ms of the buffer per 20 ms, marks echoed as reached."""
        t = time.monotonic()
        while True:
            t += FRAME_S
            await asyncio.sleep(max(0.0, t - time.monotonic()))
            if time.monotonic() < self._play_from:
                continue
            need, parts = FRAME, []
            while need and self._buffer:
                head = self._buffer[0]
                if isinstance(head, str):
                    self._buffer.popleft()
                    await self._echo(head)
                    continue
                take = head[:need]
                parts.append(take)
                need -= len(take)
                self._buffered -= len(take)
                if len(take) == len(head):
                    self._buffer.popleft()
                else:
                    self._buffer[0] = head[len(take) :]
            while self._buffer and isinstance(self._buffer[0], str):  # marks right after
                await self._echo(str(self._buffer.popleft()))
            if parts:
                frame = np.concatenate(parts)
                self.played_samples += len(frame)
                self.played.append((time.monotonic(), float(np.max(np.abs(frame)))))

    async def wait_media(self, limit_s: float, after: float = 0.0) -> float:
        """When the first media message after `after` arrived."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            for t, _ in self.received:
                if t > after:
                    return t
            await asyncio.sleep(0.01)
        raise TimeoutError(f"no media from the server within {limit_s} s")

    async def wait_clear(self, limit_s: float) -> float:
        deadline = time.monotonic() + limit_s
        while not self.clears and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        if not self.clears:
            raise TimeoutError(f"no clear from the server within {limit_s} s")
        return self.clears[0]

    async def hang_up(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.ws is not None:
            with contextlib.suppress(websockets.ConnectionClosed):
                stop = {"event": "stop", **self._ids()}
                if self.provider == "twilio":
                    stop["stop"] = {"accountSid": "AC" + "0" * 32, "callSid": self.call_id}
                await self.send(stop)
            await self.ws.close()
