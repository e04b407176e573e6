"""Fakes the gateway's tests share: a pipeline whose requests stream canned text and audio, and
helpers that speak to a session as its VAD task would."""

import asyncio
import time
from typing import Any

import numpy as np

from realtime_omni.errors import OmniError, RequestAborted
from realtime_omni.gateway.session.driver import Session
from realtime_omni.pipeline.coordinator import Output

CHUNK = 1920 * 4  # 320 ms at 24 kHz


class FakeStream:
    def __init__(self, chunks: int, gap_s: float) -> None:
        self.chunks, self.gap_s, self.taken = chunks, gap_s, 0
        self.aborted = self.closed = False

    def close(self) -> None:
        self.closed = True

    def __aiter__(self) -> "FakeStream":
        return self

    async def __anext__(self) -> Output:
        if self.aborted:
            raise RequestAborted("aborted")
        if self.taken >= self.chunks:
            raise StopAsyncIteration
        await asyncio.sleep(self.gap_s)
        self.taken += 1
        if self.taken % 2:
            return Output("decode", {"text": f"w{self.taken} ", "token_time": time.monotonic()})
        return Output(
            "code2wav", {"pcm": np.ones((4, 1920), np.float32), "token_time": time.monotonic()}
        )


class FakeCoord:
    def __init__(self, chunks: int = 20, gap_s: float = 0.0) -> None:
        self.chunks, self.gap_s = chunks, gap_s
        self.payloads: list[dict[str, Any]] = []
        self.streams: dict[str, FakeStream] = {}
        self.aborted: list[str] = []

    async def submit(self, payload: dict[str, Any], request_id: str | None = None) -> FakeStream:
        assert request_id is not None
        self.payloads.append(payload)
        self.streams[request_id] = s = FakeStream(self.chunks, self.gap_s)
        return s

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        if request_id in self.streams:
            self.streams[request_id].aborted = True


def types(s: Session) -> list[str]:
    return [e["type"] for e in s.pending_events()]


async def settle(s: Session, pred: Any, limit_s: float = 5.0, read: int = 0) -> None:
    deadline = time.monotonic() + limit_s
    while not pred():
        if read:
            s.read_output(read)
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def feed_vad(s: Session, prob: float) -> None:
    """One window's speech probability, as the session's VAD task hands it on."""
    s._on_window(prob)


def speak(s: Session, windows: int) -> None:
    for _ in range(windows):
        s.push_audio(np.full(512, 0.1, np.float32), 16000)  # the buffer, in step with the VAD
        feed_vad(s, 0.9)


def silence(s: Session, windows: int) -> None:
    for _ in range(windows):
        s.push_audio(np.zeros(512, np.float32), 16000)
        feed_vad(s, 0.0)


class UnackedCoord(FakeCoord):
    """A pipeline whose stages never acknowledge an abort: `abort` gives up after `after_s` with
    the error the coordinator raises at `runtime.abort_timeout_s`."""

    def __init__(self, after_s: float = 0.05, **kw: Any) -> None:
        super().__init__(**kw)
        self.after_s = after_s

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        await asyncio.sleep(self.after_s)
        raise OmniError(f"abort of {request_id} not acknowledged within {self.after_s} s by: ['x']")
