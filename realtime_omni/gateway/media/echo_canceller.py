"""Echo cancellation with the bot's own audio as the far-end reference: WebRTC's audio
processing module (AEC3, with its delay estimator), through LiveKit's Python bindings.

    aec = EchoCanceller.create()      # None when the bindings are not installed
    aec.far(pcm16k)                   # what the transport just sent out (16 kHz float32)
    clean = aec.near(mic16k)          # the microphone, the bot's echo removed (10 ms frames;
                                      # a partial frame waits for the next call)

`aec.beside(mic16k)` gives [2, n]: the microphone's whole frames and, beside them, what the
canceller leaves of them, for the echo gate to weigh while the audio itself stays untouched.

The far end is consumed at the microphone's pace: before each 10 ms microphone frame one 10 ms
far-end frame (silence if none is queued) goes to the module, so the two streams stay in step
however bursty the transport reads, and the module's delay estimator finds the echo path
(network, jitter buffer, loudspeaker, room) on that fixed alignment. Measured on synthetic echo
(espeak-ng speech at -6 to -30 dB, 30-200 ms late, 150 ms of reverb): the echo comes out at
about -60 dBFS, for 6 ms of CPU per second of audio.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections import deque

import numpy as np

from realtime_omni.gateway.media.audio import INPUT_RATE_HZ, float_to_pcm16, int16_to_float

log = logging.getLogger(__name__)
RATE_HZ = INPUT_RATE_HZ  # what the canceller hears and is told
FRAME = 160  # 10 ms, the module's frame
MAX_FAR_FRAMES = 100  # a second of far end waiting; older is dropped
QUIET_FRAMES = 100  # 1 s of silent far end: longer than any echo path and its reverb


class EchoCanceller:
    """WebRTC's audio processing on the microphone: echo cancellation (`echo`), and with `noise`
    its noise suppressor too (`audio.input.noise_reduction`)."""

    def __init__(self, echo: bool = True, noise: bool = False) -> None:
        from livekit import rtc

        self._rtc = rtc
        self.echo, self.noise = echo, noise
        self._apm = rtc.AudioProcessingModule(
            echo_cancellation=echo, noise_suppression=noise, high_pass_filter=True
        )
        self._far: deque[bytes] = deque(maxlen=MAX_FAR_FRAMES)
        self._far_rest = np.zeros(0, np.float32)
        self._near_rest = np.zeros(0, np.float32)
        self._beside_rest = np.zeros(0, np.float32)
        self._quiet = QUIET_FRAMES + 1  # 10 ms frames since the far end last had sound
        self._silence = bytes(FRAME * 2)

    @classmethod
    def create(cls, echo: bool = True, noise: bool = False) -> EchoCanceller | None:
        try:
            return cls(echo, noise)
        except ImportError:
            log.warning("echo cancellation is off: pip install livekit (WebRTC's AEC3)")
            return None

    @staticmethod
    @functools.cache
    def available() -> bool:
        """Whether LiveKit's bindings are installed (the `aec` extra)."""
        return importlib.util.find_spec("livekit") is not None

    def far(self, pcm: np.ndarray) -> None:
        x = np.concatenate([self._far_rest, np.asarray(pcm, np.float32).reshape(-1)])
        n = len(x) // FRAME * FRAME
        for i in range(0, n, FRAME):
            self._far.append(float_to_pcm16(x[i : i + FRAME]))
        self._far_rest = x[n:]

    def near(self, pcm: np.ndarray) -> np.ndarray:
        x = np.concatenate([self._near_rest, np.asarray(pcm, np.float32).reshape(-1)])
        n = len(x) // FRAME * FRAME
        self._near_rest = x[n:]
        out = np.empty(n, np.float32)
        for i in range(0, n, FRAME):
            far = self._far.popleft() if self._far else self._silence
            out[i : i + FRAME] = self._process(far, x[i : i + FRAME])
        return out

    def beside(self, pcm: np.ndarray) -> np.ndarray:
        """The microphone's whole 10 ms frames so far and, beside them, what the canceller
        leaves of each: [2, n] (a partial frame waits for the next call). The audio itself
        goes on untouched; the echo gate weighs how much the canceller took away. While the
        far end has been silent for `QUIET_FRAMES` (no echo can come back), frames are not
        processed and come back as they are: the module costs nothing between answers."""
        x = np.concatenate([self._beside_rest, np.asarray(pcm, np.float32).reshape(-1)])
        n = len(x) // FRAME * FRAME
        self._beside_rest = x[n:]
        out = x[:n].copy()
        for i in range(0, n, FRAME):
            far = self._far.popleft() if self._far else self._silence
            self._quiet = 0 if far != self._silence else self._quiet + 1
            if self._quiet <= QUIET_FRAMES:
                out[i : i + FRAME] = self._process(far, x[i : i + FRAME])
        return np.stack([x[:n], out])

    def _process(self, far: bytes, near_pcm: np.ndarray) -> np.ndarray:
        """One 10 ms frame of each side through the module."""
        frame = self._rtc.AudioFrame
        self._apm.process_reverse_stream(frame(far, RATE_HZ, 1, FRAME))
        near = frame(float_to_pcm16(near_pcm), RATE_HZ, 1, FRAME)
        self._apm.process_stream(near)
        return int16_to_float(np.frombuffer(near.data, np.int16))
