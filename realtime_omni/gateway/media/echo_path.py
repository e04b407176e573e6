"""A session's echo path: WebRTC's canceller on the microphone's audio itself
(`echo_cancellation`, `noise_reduction`) or, where the audio is not cancelled, the echo gate's
own canceller beside it (`echo_gate_aec`); and what is read out of the playout, handed to them
and to the echo gate as their far end at the microphone's rate. No I/O: time comes in as an
argument.

    path = EchoPath()
    if path.configure(echo=True, noise=False, gate_listens=False):   # after each session.update
        ...                                  # the gate's canceller came or went: re-window
    x = buffer.push(pcm, rate_hz, path.near())   # the microphone, cancelled if asked
    windows_in = path.beside(x)              # what the VAD gets
    path.heard(read, playout_rate_hz, gate, time.monotonic())   # after every playout read
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from realtime_omni.gateway.media.audio import INPUT_RATE_HZ, Resampler
from realtime_omni.gateway.media.echo_canceller import EchoCanceller
from realtime_omni.gateway.media.playout import Read
from realtime_omni.gateway.turns.echo import EchoGate


class EchoPath:
    def __init__(self) -> None:
        self.aec: EchoCanceller | None = None  # on the microphone's audio itself
        # The echo gate's own canceller, where the audio itself is not cancelled: what it leaves
        # of each window goes beside the window, for the gate to weigh; the VAD and the input
        # keep the microphone's own sound.
        self.gate_aec: EchoCanceller | None = None
        self._far_resampler: Resampler | None = None  # what was read out, to 16 kHz

    def configure(self, echo: bool, noise: bool, gate_listens: bool) -> bool:
        """The cancellers the settings ask for: `echo` and `noise` on the audio; where neither,
        the gate's own when `gate_listens` (`echo_gate` with `echo_gate_aec`) and the `aec`
        extra is installed. True when the gate's canceller came or went: the VAD's windows
        change shape."""
        have = (self.aec.echo, self.aec.noise) if self.aec is not None else (False, False)
        if (echo, noise) != have:
            self.aec = EchoCanceller.create(echo, noise) if echo or noise else None
        listen = self.aec is None and gate_listens
        had = self.gate_aec is not None
        if not listen:
            self.gate_aec = None
        elif self.gate_aec is None and EchoCanceller.available():
            self.gate_aec = EchoCanceller(echo=True, noise=False)
        return had != (self.gate_aec is not None)

    def near(self) -> Callable[[np.ndarray], np.ndarray] | None:
        """What the input buffer passes the microphone's 16 kHz audio through, if anything."""
        return self.aec.near if self.aec is not None else None

    def beside(self, x: np.ndarray) -> np.ndarray:
        """The microphone's 16 kHz audio as the VAD gets it: with the gate's canceller, [the
        audio, what the canceller leaves of it] (whole 10 ms frames: at most 10 ms behind)."""
        return self.gate_aec.beside(x) if self.gate_aec is not None else x

    def heard(self, r: Read, rate_hz: int, gate: EchoGate | None, now: float) -> None:
        """A read of the playout (at `rate_hz`) went out at `now`: hand it to the echo gate
        (`gate`, None when off) and the cancellers at the microphone's rate. Padding alone (no
        answer playing) is nothing the microphone can hear again: once the resampler has given
        up its tail, such reads are skipped, which is what most reads of most calls are (the
        gate counts the time it was not told of as silence, and the resampler starts afresh).
        The cancellers want a continuous far end, so they get all. A transport that reads
        without `pad` gets an empty read instead of padding: the tail is handed over then, when
        the answer ended, not at the next answer's start."""
        if not (len(r.pcm) or self._far_resampler is not None):
            return
        if gate is None and self.aec is None:
            return
        cancelling = self.aec is not None or self.gate_aec is not None
        if not r.items and not cancelling:
            if self._far_resampler is not None:
                tail, self._far_resampler = self._far_resampler.flush(), None
                if len(tail) and gate is not None:
                    gate.far(tail, now)
            return
        if not len(r.pcm):
            return
        # the far end: what the microphone may hear again, at the microphone's rate
        if self._far_resampler is None or self._far_resampler.src_hz != rate_hz:
            self._far_resampler = Resampler(rate_hz, INPUT_RATE_HZ)
        far = self._far_resampler.process(r.pcm)
        if gate is not None:
            gate.far(far, now)
        for aec in (self.aec, self.gate_aec):
            if aec is not None:
                aec.far(far)
