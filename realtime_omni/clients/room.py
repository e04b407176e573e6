"""A caller in a room, over the OpenAI Realtime WebSocket: what it hears comes out of a
loudspeaker and back into its microphone, late, quieter and with reverb, on top of what it
says. For turn-taking tests and `benchmarks/turns.py`.

    room = RoomCall("http://127.0.0.1:8000", echo_db=-12, delay_ms=100)
    await room.connect({"max_output_tokens": 40})     # session settings for session.update
    room.say(pcm24k)                                  # the person speaks (24 kHz float32)
    await room.wait("response.created", limit_s=10)
    room.events, room.deltas, room.utterances         # what happened, when (monotonic s)
    await room.close()

Every 20 ms the microphone sends what the person says (silence when nothing is queued) plus
the loudspeaker's sound of `delay_ms` ago, scaled by `echo_db` (None: no echo, a
headset), through a 150 ms reverb tail. The loudspeaker plays the audio deltas as they arrive,
after `jitter_ms`. `phone=True` makes it a narrowband call: G.711 mu-law at 8 kHz both ways.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections import deque
from typing import Any

import numpy as np
import websockets

from realtime_omni.gateway.media.audio import (
    Resampler,
    float_to_pcm16,
    pcm16_to_float,
    ulaw_decode,
    ulaw_encode,
)

RATE_HZ = 24000
TICK = 480  # 20 ms


def reverb_tail(rate: int = RATE_HZ, ms: float = 150.0, seed: int = 0) -> np.ndarray:
    """A room's impulse response: the direct sound, then an exponentially decaying tail."""
    n = int(rate * ms / 1000)
    ir = np.random.default_rng(seed).standard_normal(n) * np.exp(-np.arange(n) / (n / 6)) * 0.05
    ir[0] = 1.0
    return ir.astype(np.float32)


class RoomCall:
    def __init__(
        self,
        url: str,
        echo_db: float | None = None,
        delay_ms: float = 100.0,
        jitter_ms: float = 60.0,
        phone: bool = False,
    ) -> None:
        base = url.replace("http://", "ws://").replace("https://", "wss://").rstrip("/")
        self.url = f"{base}/v1/realtime?model=qwen3-omni"
        self.gain = None if echo_db is None else 10 ** (echo_db / 20)
        self.delay = int(RATE_HZ * delay_ms / 1000)
        self.jitter_s = jitter_ms / 1000
        self.phone = phone
        self.ir = reverb_tail()
        self.ws: Any = None
        self.events: list[tuple[float, dict[str, Any]]] = []
        self.deltas: list[tuple[float, str, int]] = []  # (arrival, item_id, samples at 24 kHz)
        self.utterances: list[list[float]] = []  # [first frame sent, last frame sent]
        self.played: list[tuple[float, bool]] = []  # (tick, loudspeaker had audio)
        self._mic: deque[tuple[np.ndarray, int]] = deque()
        self._speaker: deque[np.ndarray] = deque()
        self._speaker_len = 0
        self._play_from = 0.0
        self._line = np.zeros(self.delay, np.float32)  # loudspeaker -> microphone delay line
        self._tail = np.zeros(len(self.ir) - 1, np.float32)
        self._rx = Resampler(8000, RATE_HZ) if phone else None
        self._tx = Resampler(RATE_HZ, 8000) if phone else None
        self._tasks: list[asyncio.Task[Any]] = []

    async def connect(self, session: dict[str, Any] | None = None, limit_s: float = 10) -> None:
        self.ws = await websockets.connect(self.url, max_size=None)
        self._tasks.append(asyncio.create_task(self._receive()))
        await self.wait("session.created", limit_s)
        settings = dict(session or {})
        if self.phone:
            fmt = {"type": "audio/pcmu"}
            settings["audio"] = {
                "input": {"format": fmt, **settings.get("audio", {}).get("input", {})},
                "output": {"format": fmt},
            }
        t = time.monotonic()
        await self.send({"type": "session.update", "session": {"type": "realtime", **settings}})
        await self.wait("session.updated", limit_s, since=t)
        self._tasks.append(asyncio.create_task(self._tick()))

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(event))

    def say(self, pcm: np.ndarray) -> None:
        x = np.asarray(pcm, np.float32).reshape(-1)
        self.utterances.append([])
        for i in range(0, len(x), TICK):
            f = x[i : i + TICK]
            self._mic.append((np.pad(f, (0, TICK - len(f))), len(self.utterances) - 1))

    @property
    def saying(self) -> bool:
        return bool(self._mic)

    async def wait(
        self, kind: str, limit_s: float, since: float = 0.0
    ) -> tuple[float, dict[str, Any]]:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            for t, ev in self.events:
                if t >= since and ev.get("type") == kind:
                    return t, ev
            await asyncio.sleep(0.01)
        raise TimeoutError(f"no {kind} within {limit_s} s")

    async def _receive(self) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for raw in self.ws:
                ev = json.loads(raw)
                now = time.monotonic()
                if ev.get("type") == "response.output_audio.delta":
                    data = base64.b64decode(ev["delta"])
                    if self._rx is not None:
                        pcm = self._rx.process(ulaw_decode(data))
                    else:
                        pcm = pcm16_to_float(data)
                    if not self._speaker_len:
                        self._play_from = now + self.jitter_s
                    self._speaker.append(pcm)
                    self._speaker_len += len(pcm)
                    self.deltas.append((now, ev.get("item_id", ""), len(pcm)))
                else:
                    self.events.append((now, ev))

    def _loudspeaker(self) -> np.ndarray:
        out = np.zeros(TICK, np.float32)
        if time.monotonic() < self._play_from:
            return out
        got = 0
        while got < TICK and self._speaker:
            head = self._speaker[0]
            take = min(TICK - got, len(head))
            out[got : got + take] = head[:take]
            got += take
            if take == len(head):
                self._speaker.popleft()
            else:
                self._speaker[0] = head[take:]
        self._speaker_len -= got
        self.played.append((time.monotonic(), got > 0))
        return out

    def _echo(self, spk: np.ndarray) -> np.ndarray:
        if self.gain is None:
            return np.zeros(TICK, np.float32)
        line = np.concatenate([self._line, spk])
        late, self._line = line[:TICK], line[TICK:]
        wet = np.convolve(late * self.gain, self.ir)
        wet[: len(self._tail)] += self._tail
        self._tail = wet[TICK:].astype(np.float32)
        return wet[:TICK].astype(np.float32)

    async def _tick(self) -> None:
        noise = np.random.default_rng(1)
        t = time.monotonic()
        while True:
            near, said = self._mic.popleft() if self._mic else (np.zeros(TICK, np.float32), -1)
            mic = near + self._echo(self._loudspeaker())
            mic += noise.standard_normal(TICK).astype(np.float32) * 1e-3  # -60 dBFS room noise
            if self._tx is not None:
                data = ulaw_encode(self._tx.process(mic))
            else:
                data = float_to_pcm16(mic)
            audio = base64.b64encode(data).decode()
            await self.send({"type": "input_audio_buffer.append", "audio": audio})
            if said >= 0:
                u = self.utterances[said]
                u[:] = [u[0] if u else time.monotonic(), time.monotonic()]
            t += TICK / RATE_HZ
            await asyncio.sleep(max(0.0, t - time.monotonic()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.ws is not None:
            await self.ws.close()
