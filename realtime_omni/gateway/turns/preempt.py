"""Preemptive answers: start computing the answer when the person pauses, before the turn is
judged over, and show it only once it is.

    pre = Preempt(pause_ms=160, threshold=0.5)
    for prob, vad_event in windows:                 # one per 32 ms VAD window, in a turn
        match pre.feed(prob, vad_event, free=no_answer_active):
            case "speculate": ...   # answer the turn so far, held back: nothing is sent
            case "abandon": ...     # they went on talking: abort it, send nothing

States: `idle` (no turn, or speech now), `pausing` (silence since the last speech, shorter than
`pause_ms`), `held` (an answer to the turn up to the pause is being computed and held back).
Speech in `held` abandons the answer; the next pause speculates again on the longer turn. The
turn's end (the silence rule, or the end-of-turn model) finds the answer `held` and releases it:
the answer to exactly the audio up to the pause, which is what the turn then keeps. No I/O.
"""

from __future__ import annotations

from typing import Literal

from realtime_omni.gateway.turns.vad import WINDOW_MS, ServerVad, SpeechStarted, SpeechStopped

Verdict = Literal["speculate", "abandon"] | None


class Preempt:
    def __init__(self, pause_ms: float, threshold: float = 0.5) -> None:
        self.pause_ms = pause_ms
        self.threshold = threshold  # the VAD's: what counts as speech and as silence
        self.state: Literal["idle", "pausing", "held"] = "idle"
        self.silence_ms = 0.0

    def feed(
        self,
        prob: float,
        event: SpeechStarted | SpeechStopped | None,
        free: bool,
        window_ms: float = WINDOW_MS,
    ) -> Verdict:
        """One window. `free`: no answer is active, so one may be computed now."""
        if isinstance(event, SpeechStopped):  # the turn ended: a held answer is taken as it is
            self.state, self.silence_ms = "idle", 0.0
            return None
        if isinstance(event, SpeechStarted):
            self.state, self.silence_ms = "pausing", 0.0
            return None
        if self.state == "idle":
            return None
        if prob >= self.threshold:
            self.silence_ms = 0.0
            if self.state == "held":
                self.state = "pausing"
                return "abandon"
            return None
        if prob < self.threshold - ServerVad.HYSTERESIS:
            self.silence_ms += window_ms
            if self.state == "pausing" and self.silence_ms >= self.pause_ms and free:
                self.state = "held"
                return "speculate"
        return None

    def reset(self) -> Verdict:
        """No turn any longer (the input was cleared): a held answer is abandoned."""
        held = self.state == "held"
        self.state, self.silence_ms = "idle", 0.0
        return "abandon" if held else None
