"""Voice activity: silero-vad probabilities on 32 ms windows of 16 kHz audio, and the OpenAI
`server_vad` turn rules over them.

`ServerVad` is the decision (no I/O, no torch): feed it one probability per window, it answers
`SpeechStarted` / `SpeechStopped` with the OpenAI timestamps. `Windower` cuts any chunks into
windows. The model that makes the probabilities is `models/silero_vad.py`'s `SileroVad`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from realtime_omni.gateway.media.audio import INPUT_RATE_HZ

WINDOW_SAMPLES = 512  # silero-vad's window at 16 kHz
WINDOW_MS = WINDOW_SAMPLES * 1000 / INPUT_RATE_HZ  # 32 ms


@dataclass(frozen=True)
class VadParams:
    """OpenAI `server_vad` parameters (their defaults)."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500


@dataclass(frozen=True)
class SpeechStarted:
    audio_start_ms: int  # where the turn's audio begins: the first speech window minus padding
    detected_ms: int  # end of the window that crossed the threshold


@dataclass(frozen=True)
class SpeechStopped:
    audio_end_ms: int  # end of the turn's audio, the trailing silence included


class ServerVad:
    """The `server_vad` state machine over window probabilities.

    Speech starts on the first window at or above `threshold`. It stops once windows below
    `threshold - 0.15` (silero's own hysteresis) have lasted `silence_duration_ms`; a window
    between the two thresholds neither starts nor ends silence. Times are milliseconds of audio
    since the stream began (window ends), so they match the input buffer, not the wall clock.
    """

    HYSTERESIS = 0.15

    def __init__(self, params: VadParams | None = None) -> None:
        self.params = params or VadParams()
        self.speaking = False
        self.elapsed_ms = 0.0  # audio fed so far
        self._silence_start_ms: float | None = None

    def feed(
        self, prob: float, window_ms: float = WINDOW_MS
    ) -> SpeechStarted | SpeechStopped | None:
        start_ms = self.elapsed_ms
        self.elapsed_ms += window_ms
        p = self.params
        if not self.speaking:
            if prob >= p.threshold:
                self.speaking = True
                self._silence_start_ms = None
                begin = max(0.0, start_ms - p.prefix_padding_ms)
                return SpeechStarted(round(begin), round(self.elapsed_ms))
            return None
        if prob >= p.threshold:
            self._silence_start_ms = None
        elif prob < p.threshold - self.HYSTERESIS:
            if self._silence_start_ms is None:
                self._silence_start_ms = start_ms
            if self.elapsed_ms - self._silence_start_ms >= p.silence_duration_ms:
                self.speaking = False
                self._silence_start_ms = None
                return SpeechStopped(round(self.elapsed_ms))
        return None

    def stop(self) -> SpeechStopped:
        """End the turn in progress now (the end-of-turn model heard it complete)."""
        self.speaking = False
        self._silence_start_ms = None
        return SpeechStopped(round(self.elapsed_ms))

    def reset(self) -> None:
        """Forget a turn in progress (the input buffer was cleared); time goes on."""
        self.speaking = False
        self._silence_start_ms = None


class Windower:
    """Cuts a 16 kHz stream into `WINDOW_SAMPLES` windows; holds at most one partial window.
    A stream of [k, n] chunks (the microphone beside what the echo canceller leaves of it) is
    cut along its last axis into [k, size] windows; one stream keeps one shape."""

    def __init__(self, size: int = WINDOW_SAMPLES) -> None:
        self.size = size
        self._rest: np.ndarray | None = None

    def push(self, x: np.ndarray) -> list[np.ndarray]:
        x = np.asarray(x, np.float32)
        x = x if x.ndim == 2 else x.reshape(-1)
        buf = x if self._rest is None else np.concatenate([self._rest, x], axis=-1)
        n = buf.shape[-1] // self.size
        self._rest = buf[..., n * self.size :].copy()
        return [buf[..., i * self.size : (i + 1) * self.size] for i in range(n)]
