"""The person's audio from the input buffer to the VAD's verdicts: 32 ms windows, each with its
speech probability and when its last sample arrived.

    hearing = Hearing(vad_model)
    hearing.push(x, end, now)          # 16 kHz audio appended up to absolute sample `end`
    if await hearing.wait(timeout_s):  # False: nothing came within timeout_s
        async for part in hearing.judge():   # a second of windows per model pass
            for w in part: ...         # w.prob, w.mic, w.arrived, w.clean
    hearing.reset(end)                 # the input was cleared at absolute sample `end`

The model judges up to `WINDOWS_PER_PASS` windows at once (with every other session's, in a
worker thread: `models/silero_vad.py`); a minute appended at once is judged a second at a time,
the event loop (every call's audio) free between passes. No decisions here: the session hands
each verdict to its `TurnTaker`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from realtime_omni.aio import wait_set
from realtime_omni.gateway.turns.vad import Windower

log = logging.getLogger(__name__)

WINDOWS_PER_PASS = 32  # 1 s of 32 ms windows judged per model pass
# Audio waiting for the VAD at most (a minute appended at once is judged whole); past it, the
# oldest is skipped unjudged (`skipped`), so a stream the shared VAD cannot keep up with (many
# sessions sending faster than real time) holds no more than this, nor makes its passes longer.
MAX_PENDING_SAMPLES = 60 * 16000


class VadModel(Protocol):
    async def probs(self, windows: list[np.ndarray]) -> list[float]: ...
    def reset(self) -> None: ...


@dataclass(frozen=True)
class Heard:
    """One window's verdict."""

    prob: float  # P(speech)
    mic: np.ndarray  # the microphone's window
    arrived: float  # monotonic time its last sample arrived
    clean: np.ndarray | None  # what the echo gate's canceller left of it, where it listens


class Hearing:
    def __init__(self, model: VadModel | None = None) -> None:
        self.model = model
        self.judged = 0  # absolute input samples the VAD has judged
        self._windower = Windower()
        self._pending: deque[np.ndarray] = deque()  # [n] or, beside the canceller's, [2, n]
        self._pending_samples = 0
        self.skipped = 0  # input samples never judged: past MAX_PENDING_SAMPLES
        self._resume_at: int | None = None  # where judging starts again after a skip
        self._wake = asyncio.Event()
        self._arrivals: deque[tuple[int, float]] = deque(maxlen=4096)  # (input end, time)

    def push(self, x: np.ndarray, end: int, now: float) -> None:
        """Audio to judge (16 kHz; [2, n]: the microphone beside what a canceller left of it),
        ending at absolute input sample `end`, which arrived at `now`."""
        self._arrivals.append((end, now))
        self._pending.append(x)
        self._pending_samples += x.shape[-1]
        if self._pending_samples > MAX_PENDING_SAMPLES:
            self._skip(end)
        self._wake.set()

    def _skip(self, end: int) -> None:
        """Keep the newest whole chunks within `MAX_PENDING_SAMPLES`; the rest is skipped, and
        judging starts afresh after it (as after a reset, the model's state too)."""
        while self._pending_samples > MAX_PENDING_SAMPLES and len(self._pending) > 1:
            self._pending_samples -= self._pending.popleft().shape[-1]
        if self._pending_samples > MAX_PENDING_SAMPLES:  # one chunk longer than the bound
            self._pending[0] = self._pending[0][..., -MAX_PENDING_SAMPLES:]
            self._pending_samples = MAX_PENDING_SAMPLES
        self._resume_at = end - self._pending_samples

    def _resume(self) -> None:
        """After a skip, judging starts afresh at the first sample kept (done as a pass
        begins: a pass under way goes on with the windows it took)."""
        if self._resume_at is None:
            return
        skipped = max(0, self._resume_at - self.judged)
        self.skipped += skipped
        log.warning("the VAD fell %.1f s behind this stream: skipped unjudged", skipped / 16000)
        self.judged, self._resume_at = self._resume_at, None
        self._windower = Windower()
        if self.model is not None:
            self.model.reset()

    def reset(self, end: int) -> None:
        """The input was cleared at absolute sample `end`: nothing before it is judged."""
        self._pending.clear()
        self._pending_samples = 0
        self._resume_at = None
        self.judged = end
        self._windower = Windower()
        if self.model is not None:
            self.model.reset()

    def reshape(self) -> None:
        """The windows change shape (a canceller put beside the microphone, or taken away)."""
        self._pending.clear()
        self._pending_samples = 0
        self._windower = Windower()

    async def wait(self, timeout_s: float | None = None) -> bool:
        """Until audio was pushed (True), or `timeout_s` passed without (False)."""
        if timeout_s is None:
            await self._wake.wait()
        elif not await wait_set(self._wake, timeout_s):
            return False
        self._wake.clear()
        return True

    async def judge(self) -> AsyncIterator[list[Heard]]:
        """The verdicts on the windows pushed so far, a model pass at a time."""
        self._resume()
        chunks, self._pending, self._pending_samples = self._pending, deque(), 0
        windows = [w for c in chunks for w in self._windower.push(c)]
        if self.model is None:
            return
        for i in range(0, len(windows), WINDOWS_PER_PASS):
            part = windows[i : i + WINDOWS_PER_PASS]
            mics = [w[0] if w.ndim == 2 else w for w in part]
            heard = []
            for p, w, mic in zip(await self.model.probs(mics), part, mics, strict=True):
                self.judged += len(mic)
                clean = w[1] if w.ndim == 2 else None
                heard.append(Heard(p, mic, self._arrival(self.judged), clean))
            yield heard

    def _arrival(self, end: int) -> float:
        """When the input sample before absolute index `end` arrived."""
        while len(self._arrivals) > 1 and self._arrivals[0][0] < end:
            self._arrivals.popleft()
        return self._arrivals[0][1] if self._arrivals else time.monotonic()
