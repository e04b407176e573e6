"""Echo cancellation with the bot's own audio as the far-end reference: WebRTC's audio
processing module (AEC3, with its delay estimator), through LiveKit's Python bindings.

    aec = EchoCanceller.create()      # None when the bindings are not installed
    aec.far(pcm16k)                   # what the transport just sent out (16 kHz float32)
    clean = aec.near(mic16k)          # the microphone, the bot's echo removed (10 ms frames;
                                      # a partial frame waits for the next call)

The far end is consumed at the microphone's pace: before each 10 ms microphone frame one 10 ms
far-end frame (silence if none is queued) goes to the module, so the two streams stay in step
however bursty the transport reads, and the module's delay estimator finds the echo path
(network, jitter buffer, loudspeaker, room) on that fixed alignment. Measured on synthetic echo
(espeak-ng speech at -6 to -30 dB, 30-200 ms late, 150 ms of reverb): the echo comes out at
about -60 dBFS, for 6 ms of CPU per second of audio.
"""

from __future__ import annotations

import logging
from collections import deque

import numpy as np

log = logging.getLogger(__name__)
RATE_HZ = 16000
FRAME = 160  # 10 ms, the module's frame
MAX_FAR_FRAMES = 100  # a second of far end waiting; older is dropped


class EchoCanceller:
    def __init__(self) -> None:
        from livekit import rtc

        self._rtc = rtc
        self._apm = rtc.AudioProcessingModule(echo_cancellation=True, high_pass_filter=True)
        self._far: deque[bytes] = deque(maxlen=MAX_FAR_FRAMES)
        self._far_rest = np.zeros(0, np.float32)
        self._near_rest = np.zeros(0, np.float32)
        self._silence = bytes(FRAME * 2)

    @classmethod
    def create(cls) -> EchoCanceller | None:
        try:
            return cls()
        except ImportError:
            log.warning("echo cancellation is off: pip install livekit (WebRTC's AEC3)")
            return None

    def far(self, pcm: np.ndarray) -> None:
        x = np.concatenate([self._far_rest, np.asarray(pcm, np.float32).reshape(-1)])
        n = len(x) // FRAME * FRAME
        for i in range(0, n, FRAME):
            self._far.append(_pcm16(x[i : i + FRAME]))
        self._far_rest = x[n:]

    def near(self, pcm: np.ndarray) -> np.ndarray:
        x = np.concatenate([self._near_rest, np.asarray(pcm, np.float32).reshape(-1)])
        n = len(x) // FRAME * FRAME
        self._near_rest = x[n:]
        out = np.empty(n, np.float32)
        frame = self._rtc.AudioFrame
        for i in range(0, n, FRAME):
            far = self._far.popleft() if self._far else self._silence
            self._apm.process_reverse_stream(frame(far, RATE_HZ, 1, FRAME))
            near = frame(_pcm16(x[i : i + FRAME]), RATE_HZ, 1, FRAME)
            self._apm.process_stream(near)
            out[i : i + FRAME] = np.frombuffer(near.data, np.int16) / 32768.0
        return out


def _pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1.0, 1.0) * 32767).astype(np.int16).tobytes()


class EchoGate:
    """A double-talk detector: is what the microphone hears the bot's own audio coming back?
    No I/O; numpy energies only.

        gate = EchoGate()
        gate.far(pcm16k)               # what the transport just sent out (16 kHz)
        echo = gate.window(mic_window)  # per VAD window: True if its energy is explained by
                                        # the bot's audio through the echo path

    The far end is consumed at the microphone's pace, as the canceller's is, one energy per
    window. The echo path is modelled on those energies: the microphone's energy is a
    non-negative mix of the far end's over the last `max_delay_ms` (the delay of network,
    jitter buffer and loudspeaker, and the room's reverb), fitted by least squares every few
    windows on the windows the model itself calls echo or silence, so the person's own speech
    never teaches it (adaptation frozen in double talk, as echo cancellers do), and trusted only
    while it predicts the sound it was fitted on within `max_error_db` (a person talking over a
    bot nobody hears back does not follow the far end, so no path is learnt). A window within
    `margin_db` of its predicted echo is echo; a person talking over the bot is louder than the
    echo of what the bot said. Until `min_windows` of far-end activity were learnt from,
    nothing is judged echo.
    """

    def __init__(
        self,
        max_delay_ms: float = 560.0,
        margin_db: float = 3.0,
        history_s: float = 8.0,
        min_windows: int = 16,
        window: int = 512,
    ) -> None:
        self.size = window
        self.taps = max(1, round(max_delay_ms * 16 / window))
        self._far_env: deque[float] = deque([0.0] * self.taps, maxlen=self.taps)
        n = round(history_s * 16000 / window)
        self._rows: deque[np.ndarray] = deque(maxlen=n)  # far-end energies per learnt window
        self._mics: deque[float] = deque(maxlen=n)
        self._fifo: deque[np.ndarray] = deque()
        self._fifo_len = 0
        self.margin = 10 ** (margin_db / 10)
        self.min_windows = min_windows
        self.active_floor = 1e-7  # far-end energy (-70 dBFS) below which the bot is silent
        self.max_error_db = 6.0  # a fit further off than this (median) is not an echo path
        self.path: np.ndarray | None = None  # energy gain per delay, in windows
        self._since_fit = 0

    def far(self, pcm: np.ndarray) -> None:
        x = np.asarray(pcm, np.float32).reshape(-1)
        if len(x):
            self._fifo.append(x)
            self._fifo_len += len(x)
        while self._fifo_len > 16000:  # a second at most waits
            self._fifo_len -= len(self._fifo.popleft())

    def _take(self, n: int) -> np.ndarray:
        parts, need = [], n
        while need and self._fifo:
            head = self._fifo[0]
            parts.append(head[:need])
            if len(head) <= need:
                self._fifo.popleft()
            else:
                self._fifo[0] = head[need:]
            need -= len(parts[-1])
        self._fifo_len -= n - need
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def _fit(self) -> None:
        x, y = np.asarray(self._rows), np.asarray(self._mics)
        keep = np.ones(len(y), bool)
        for _ in range(3):  # least squares, then again without what it cannot explain
            h, *_ = np.linalg.lstsq(x[keep], y[keep], rcond=None)
            h = np.maximum(h, 0.0)
            keep = y <= 4 * (x @ h) + 1e-12
            if keep.sum() < self.min_windows:
                break
        # Trusted only if it explains the sound it was fitted on: the bot's echo follows the
        # far end's energy, a person talking does not. Silent windows (below -70 dBFS) say
        # nothing either way.
        pred, sound = x @ h, y > self.active_floor
        if sound.sum() >= self.min_windows:
            err = np.abs(10 * np.log10((y[sound] + 1e-12) / (pred[sound] + 1e-12)))
            if float(np.median(err)) > self.max_error_db:
                self.path = None
                return
        self.path = h

    def window(self, mic: np.ndarray) -> bool:
        far = self._take(len(mic))
        self._far_env.appendleft(float(np.mean(np.square(far))) if len(far) else 0.0)
        row = np.asarray(self._far_env)  # newest first: row[k] is k windows ago
        if row.max() < self.active_floor:
            return False
        mic_e = float(np.mean(np.square(np.asarray(mic, np.float32))))
        echo = self.path is not None and mic_e <= self.margin * float(row @ self.path)
        if self.path is None or echo:  # learn from echo and silence, never from double talk
            self._rows.append(row)
            self._mics.append(mic_e)
            self._since_fit += 1
            if len(self._mics) >= self.min_windows and self._since_fit >= 8:
                self._since_fit = 0
                self._fit()
        return echo
