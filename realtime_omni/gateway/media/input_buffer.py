"""The person's audio waiting to become a turn: 16 kHz float32 samples on an absolute sample
index, so the VAD's speech start and stop (in ms since the buffer began) can be cut out of it.
No I/O, no asyncio.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from realtime_omni.gateway.media.audio import INPUT_RATE_HZ, Resampler, int16_to_float

MAX_INPUT_MS = 120_000  # older audio is dropped past this
# Audio a client may send ahead of real time: one full-size append at once (8 MiB of base64
# pcm16 is 125 s), then at most MAX_INPUT_SPEED x real time. More is refused, not queued: 750 s
# of noise appended in 0.9 s cost about 20 s of the VAD's CPU.
INPUT_BURST_S = 130.0
MAX_INPUT_SPEED = 4.0


def b64_seconds(chars: int, sample_bytes: int, rate_hz: int) -> float:
    """Seconds of audio in `chars` characters of base64, judged before any decoding."""
    return chars * 3 // 4 / sample_bytes / rate_hz


class AudioCredit:
    """Seconds of audio a client may still send now: `burst_s` at first, refilled at `speed`
    seconds of audio per second of real time, never above `burst_s`. No clock of its own."""

    def __init__(self, burst_s: float = INPUT_BURST_S, speed: float = MAX_INPUT_SPEED) -> None:
        self.burst_s, self.speed = burst_s, speed
        self.credit_s = burst_s
        self._at: float | None = None

    def take(self, seconds: float, now: float) -> bool:
        """Spend `seconds` of credit at time `now` (monotonic s); False, spending nothing, when
        there is not that much."""
        if self._at is not None:
            self.credit_s = min(self.burst_s, self.credit_s + (now - self._at) * self.speed)
        self._at = now
        if seconds > self.credit_s:
            return False
        self.credit_s -= seconds
        return True


class InputBuffer:
    """Samples [`start`, `end`) at `INPUT_RATE_HZ`, held at most `max_ms` back from `end`."""

    def __init__(self, max_ms: int = MAX_INPUT_MS) -> None:
        self.max_samples = max_ms * INPUT_RATE_HZ // 1000
        self._chunks: list[np.ndarray] = []
        self.start = 0  # absolute index of the first sample still held
        self.end = 0  # absolute index after the last sample
        self._resamplers: dict[int, Resampler] = {}  # one per input rate: they keep filter state

    def push(
        self,
        pcm: np.ndarray,
        rate_hz: int,
        clean: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> np.ndarray:
        """Append audio at any rate, float32 [-1, 1] or int16, passed at 16 kHz through `clean`
        (the echo canceller) when given; gives what was appended."""
        x = np.asarray(pcm)
        x = int16_to_float(x) if x.dtype == np.int16 else x.astype(np.float32)
        x = x.reshape(-1)
        if rate_hz != INPUT_RATE_HZ:
            r = self._resamplers.get(rate_hz)
            if r is None:
                r = self._resamplers[rate_hz] = Resampler(rate_hz, INPUT_RATE_HZ)
            x = r.process(x)
        if clean is not None:
            x = clean(x)
        if not len(x):
            return x
        self._chunks.append(x)
        self.end += len(x)
        while self.end - self.start - len(self._chunks[0]) >= self.max_samples:
            self.start += len(self._chunks.pop(0))
        return x

    def slice(self, start: int, end: int) -> np.ndarray:
        """Samples [start, end) (absolute indices), what of them is still held."""
        out, pos = [], self.start
        for c in self._chunks:
            a, b = max(start, pos), min(end, pos + len(c))
            if a < b:
                out.append(c[a - pos : b - pos])
            pos += len(c)
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def trim(self, keep_from: int) -> None:
        """Drop whole chunks that end before `keep_from`."""
        while self._chunks and self.start + len(self._chunks[0]) <= keep_from:
            self.start += len(self._chunks.pop(0))

    def clear(self) -> None:
        self._chunks.clear()
        self.start = self.end
