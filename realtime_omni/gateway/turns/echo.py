"""The echo gate: is the microphone hearing the bot's own voice come back? It compares each VAD
window with what was read out (the far end), by energy along a learnt echo path and by waveform,
and, with the session's `echo_gate_aec`, by what WebRTC's canceller (`media/echo_canceller.py`)
leaves of it. A window it takes for echo counts as silence for the VAD and the turn policy. No
I/O: the far end and the windows come with their times.
"""

from __future__ import annotations

import logging
from collections import deque

import numpy as np

from realtime_omni.gateway.media.audio import INPUT_RATE_HZ

log = logging.getLogger(__name__)
RATE_HZ = INPUT_RATE_HZ  # what the gate hears
# The thresholds below sit between what echo and a person talking over the bot score; the
# figures they were chosen on are in benchmarks/README.md ("How the echo gate's thresholds were
# chosen").
# A window the canceller leaves this much quieter was the bot's echo, whatever its energy says
# (a converged canceller takes more from echo than from a person's speech).
ECHO_CANCELLED_DB = 24.0
# A window whose sound matches the far end's this closely at some delay within the echo path's
# reach is echo, whatever its energy says: the normalised cross-correlation of the last
# `CORRELATION_WINDOWS` microphone windows with the far end, both at 8 kHz and pre-emphasised
# (so that voiced speech's low harmonics, alike in any two voices, weigh less).
ECHO_CORRELATION = 0.6
# ... and this closely for a window no louder than the far end's loudest slot, as echo always is.
QUIET_ECHO_CORRELATION = 0.5
CORRELATION_WINDOWS = 3  # 96 ms: one window alone is too short to tell two voices apart
_PRE_EMPHASIS = 0.9


def cancelled_db(mic: np.ndarray, clean: np.ndarray) -> float:
    """How much quieter the canceller left a window than the microphone heard it, in dB (0 for
    a silent window)."""
    e_mic = float(np.mean(np.square(mic, dtype=np.float64)))
    if e_mic < 1e-9:  # under -90 dBFS: nothing to judge
        return 0.0
    e_clean = float(np.mean(np.square(clean, dtype=np.float64)))
    return float(10 * np.log10(e_mic / max(e_clean, 1e-12)))


class EchoGate:
    """A double-talk detector: is what the microphone hears the bot's own audio coming back?
    No I/O; numpy energies only.

        gate = EchoGate()
        gate.far(pcm16k, t)              # what the transport sent out at time t (16 kHz)
        echo = gate.window(mic_window, t)  # per VAD window that arrived at t: True if its energy
                                           # is explained by the bot's audio through the echo path

    Both sides are put on the clock: far-end audio is taken to play from when it was sent (or
    right after what was sent before it, for a transport that sends ahead), one energy per
    32 ms slot; a microphone window is compared with the far end's slots before its arrival.
    The echo path is modelled on those energies: the microphone's energy is a non-negative mix
    of the far end's over the last `max_delay_ms` (network, jitter buffer, loudspeaker, the
    room's reverb), fitted by least squares every few windows on the windows the model itself
    calls echo or silence, so the person's own speech never teaches it (adaptation frozen in
    double talk, as echo cancellers do), and trusted only while it predicts the sound it was
    fitted on within `max_error_db`, rising and falling with it (`min_correlation` of the log
    energies): a person talking over a bot nobody hears back does not follow the far end, and
    a far end that does not vary (a test tone) shows no path at all, so none is learnt. A
    window within `margin_db` of its predicted echo is echo; a person talking over the bot is
    louder than the echo of what it said. Until a path is learnt, sound 10 dB under the far
    end is taken for echo, and louder sound whose waveform matches the far end's at some delay
    (`correlate`; `ECHO_CORRELATION`), which needs no path learnt (energies alone cannot tell a
    loud early echo from a person before the path is learnt). The waveform
    is compared wherever the energies call a window something else, and one window that is not
    echo right after one surely echo is not yet a person. Given what an echo canceller leaves
    of each window (the session's `echo_gate_aec`), a window it takes `ECHO_CANCELLED_DB` from
    is echo too.
    """

    SLOT_S = 0.032

    def __init__(
        self,
        max_delay_ms: float = 640.0,
        margin_db: float = 4.5,
        history_s: float = 8.0,
        min_windows: int = 16,
        correlate: bool = True,
    ) -> None:
        self.taps = max(1, round(max_delay_ms / 1000 / self.SLOT_S))
        self.correlate = correlate
        self._lag = round(max_delay_ms / 1000 * RATE_HZ)  # the far end's samples searched back
        self._keep = self._lag + (CORRELATION_WINDOWS + 1) * 512 + RATE_HZ // 10
        self._pcm = np.zeros(0, np.float32)  # the far end's latest samples, on the play clock
        self._pcm_end = 0  # absolute sample index (16 kHz since the clock's 0) after them
        self._recent: deque[np.ndarray] = deque(maxlen=CORRELATION_WINDOWS)  # microphone
        self._slots: dict[int, float] = {}  # slot -> summed squares of far-end samples in it
        self._far_clock = 0.0  # when the far end sent so far ends playing
        n = round(history_s / self.SLOT_S)
        self._rows: deque[np.ndarray] = deque(maxlen=n)  # far-end energies per learnt window
        self._mics: deque[float] = deque(maxlen=n)
        self.margin = 10 ** (margin_db / 10)
        self.min_windows = min_windows
        self.active_floor = 1e-7  # far-end energy (-70 dBFS) below which the bot is silent
        self.max_error_db = 6.0  # a fit further off than this (median) is not an echo path
        self.min_correlation = 0.5  # nor one whose prediction does not rise and fall with it
        # Before a path is learnt, sound 10 dB under the far end is taken for its echo; louder
        # echo is told by its waveform (`correlate`). Without it the prior must be looser (6 dB),
        # which also takes a person's quieter first words over an answer for echo.
        self.prior = 0.1 if correlate else 0.25
        self.path: np.ndarray | None = None  # energy gain per delay, in slots
        self.floor = 0.0  # the microphone's energy with nobody talking and no echo
        self._last = False  # the previous window was echo
        self._since_fit = 0

    @property
    def may_echo(self) -> bool:
        """Whether echo may come back: no path learnt yet, or one with some gain (a headset's
        microphone, silent while the bot spoke, has the path "no echo")."""
        return self.path is None or bool(self.path.any())

    def far(self, pcm: np.ndarray, t: float) -> None:
        x = np.asarray(pcm, np.float32).reshape(-1)
        if not len(x):
            return
        start = max(t, self._far_clock)
        self._far_clock = start + len(x) / RATE_HZ
        if self.correlate:
            gap = min(round(start * RATE_HZ) - self._pcm_end, self._keep)
            parts = [self._pcm, np.zeros(max(gap, 0), np.float32), x]
            self._pcm = np.concatenate(parts)[-self._keep :]
            self._pcm_end = max(self._pcm_end, round(start * RATE_HZ)) + len(x)
        # each sample's slot, by when it plays; the squares summed per slot
        slots = ((start + np.arange(len(x)) / RATE_HZ) / self.SLOT_S).astype(np.int64)
        keys, at = np.unique(slots, return_index=True)
        sums = np.add.reduceat(np.square(x.astype(np.float64)), at)
        for slot, energy in zip(keys.tolist(), sums.tolist(), strict=True):
            self._slots[slot] = self._slots.get(slot, 0.0) + energy
        first = int(keys[0])
        for old in [k for k in self._slots if k < first - 4 * self.taps]:
            del self._slots[old]

    def _fit(self) -> None:
        x, y = np.asarray(self._rows), np.asarray(self._mics)
        self.floor = float(np.quantile(y, 0.1))  # the room's own noise
        y = np.maximum(y - self.floor, 0.0)
        keep = np.ones(len(y), bool)
        for _ in range(3):  # least squares, then again without what it cannot explain
            h, *_ = np.linalg.lstsq(x[keep], y[keep], rcond=None)
            h = np.maximum(h, 0.0)
            keep = y <= 4 * (x @ h) + 1e-12
            if keep.sum() < self.min_windows:
                break
        pred, sound = x @ h, y > y.max() * 1e-3  # within 30 dB of the loudest: not the floor
        if sound.sum() < self.min_windows:
            # Too little sound to check a path on, and a few windows may be the person. A
            # microphone mostly silent while the bot spoke says that no echo comes back.
            if len(y) - sound.sum() >= self.min_windows:
                self.path = np.zeros_like(h)
            return
        ly, lp = np.log10(y[sound] + 1e-12), np.log10(pred[sound] + 1e-12)
        err = float(np.median(np.abs(10 * (ly - lp))))
        follows = float(np.corrcoef(ly, lp)[0, 1]) if np.std(lp) > 0 else 0.0
        log.debug("echo fit: %d windows, error %.1f dB, r %.2f", len(y), err, follows)
        verified = err <= self.max_error_db and follows >= self.min_correlation
        self.path = h if verified else None

    def window(self, mic: np.ndarray, t: float, clean: np.ndarray | None = None) -> bool:
        """`clean`: the window through an echo canceller fed the same far end
        (`EchoCanceller.beside`). Where echo may come back, a window it leaves
        `ECHO_CANCELLED_DB` quieter is echo whatever the energies say; the path is learnt from
        the energies alone. (Where no echo comes back, a headset, the canceller's suppressor
        would still damp a person heard over the far end while it learns.)"""
        now = int((t - self.SLOT_S / 2) / self.SLOT_S)  # the slot of the window's middle
        per = self.SLOT_S * RATE_HZ
        row = np.array([self._slots.get(now - k, 0.0) / per for k in range(self.taps)])
        self._recent.append(np.asarray(mic, np.float32).reshape(-1))
        if row.max() < self.active_floor:
            self._last = False
            return False
        mic_e = float(np.mean(np.square(np.asarray(mic, np.float32))))
        if self.path is None:  # before a path is learnt: what is 6 dB under the far end
            echo = mic_e <= self.prior * float(row.max())
        else:
            echo = mic_e <= self.margin * float(row @ self.path) + self.floor
        if self.path is None or echo:  # learn from echo and silence, never from double talk
            self._rows.append(row)
            self._mics.append(mic_e)
            self._since_fit += 1
            if len(self._mics) >= self.min_windows and self._since_fit >= 8:
                self._since_fit = 0
                self._fit()
        matched = False  # the far end's waveform is in the window
        if not echo and self.correlate and self.may_echo:
            bar = ECHO_CORRELATION if mic_e > float(row.max()) else QUIET_ECHO_CORRELATION
            echo = matched = self.correlation(round(t * RATE_HZ)) >= bar
        if not echo and clean is not None and self.may_echo:
            echo = cancelled_db(mic, clean) >= ECHO_CANCELLED_DB
        sure = matched or (echo and self.path is not None)  # not by the prior
        # One window that is not echo right after one surely echo is not yet a person: the
        # fit's error and the correlation's scatter single windows out of echo; a person stays
        # out of it. (The prior is no such sign: it takes a person's quiet first words for echo.)
        after_echo, self._last = self._last, sure and mic_e > 2 * self.floor  # echo, not silence
        return echo or after_echo

    def correlation(self, mic_end: int) -> float:
        """The best normalised cross-correlation of the latest microphone windows (the last
        ending at absolute sample `mic_end`) with the far end that played up to `max_delay_ms`
        before them; 0 when there is nothing to compare."""
        m = _emphasised(np.concatenate(self._recent))
        a = mic_end - len(m) * 2 - self._lag  # the far end's first sample that may be in them
        have = self._pcm_end - len(self._pcm)
        far = np.zeros(mic_end - a, np.float32)
        lo, hi = max(a, have), min(mic_end, self._pcm_end)
        if hi > lo:
            far[lo - a : hi - a] = self._pcm[lo - have : hi - have]
        f = _emphasised(far)
        wm, e_m = len(m), float(np.dot(m, m))
        if e_m < 1e-9 or len(f) < wm:
            return 0.0
        n = 1 << (len(f) + wm - 1).bit_length()
        c = np.fft.irfft(np.fft.rfft(f, n) * np.conj(np.fft.rfft(m, n)), n)[: len(f) - wm + 1]
        cum = np.concatenate([[0.0], np.cumsum(np.square(f, dtype=np.float64))])
        e_f = cum[wm:] - cum[:-wm]  # the far end's energy under each lag
        r = c / np.sqrt(np.maximum(e_f, 1e-12) * e_m)
        r[e_f < 1e-7 * wm] = 0.0  # a silent stretch of far end explains nothing
        return float(r.max())


def _emphasised(x: np.ndarray) -> np.ndarray:
    """16 kHz to 8 kHz (a [1, 2, 1] / 4 low-pass), then first-order pre-emphasis."""
    x = x[: len(x) // 2 * 2].astype(np.float64)
    y = 0.5 * x[1::2] + 0.25 * (x[0::2] + np.concatenate([x[2::2], [0.0]]))
    return np.concatenate([[0.0], y[1:] - _PRE_EMPHASIS * y[:-1]])
