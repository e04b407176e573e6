"""Turn-taking while the bot speaks: pause first, abort when sure. No I/O, no asyncio, no torch.

    policy = TurnPolicy(TurnParams())
    for prob in window_probabilities:                      # one per 32 ms VAD window
        for decision in policy.feed(prob, vad_event, bot_speaking=playing):
            ...                                            # PAUSE, RESUME, BARGE_IN

The VAD (`vad.ServerVad`) says when speech starts and stops; this policy decides what speech
that starts over the bot's answer means:

- it pauses the answer at once (`PAUSE`: the next outgoing frame is silent, nothing is dropped);
- once the speech over it has lasted `min_interruption_ms` (speech windows counted, pauses in it
  not), the person is interrupting: `BARGE_IN` (abort the answer in every stage, keep what was
  heard; the speech goes on as the next user turn);
- if the speech stops first (`resume_after_ms` of silence) it was a cough, a click, a
  backchannel ("mhm", "yeah", "okay") or residual echo: `RESUME` where the answer paused, and
  the blip is dropped, not committed as a turn (`DISCARD`: the session clears the buffered
  speech and resets the VAD, so the next speech starts afresh).

`min_interruption_ms: 0` is the old behaviour: any speech start over the bot is a barge-in.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from realtime_omni.gateway.turns.vad import WINDOW_MS, ServerVad, SpeechStarted, SpeechStopped


class Decision(Enum):
    PAUSE = "pause"  # silence the answer from the next frame; keep what is queued
    RESUME = "resume"  # play the answer on from where it paused
    BARGE_IN = "barge_in"  # a real interruption: abort the answer, truncate it to what was heard
    DISCARD = "discard"  # the speech over the bot was not a turn: drop it, commit nothing


@dataclass(frozen=True)
class TurnParams:
    # Speech over the bot this long (speech windows, summed) is an interruption. "mhm",
    # "yeah", "okay" and a cough are shorter: espeak-ng's longest backchannel ("mhm") holds 576
    # ms of speech windows, a real one about 300-400. LiveKit's default is 500 ms.
    min_interruption_ms: int = 700
    # Speech over the bot that then stays silent this long was not an interruption; long enough
    # for the pause after a comma ("Hello, how are you").
    resume_after_ms: int = 500
    # Sound the echo gate (`echo.EchoGate`) explains as the bot's own audio coming back through
    # the microphone is taken as silence, by the VAD as by this policy.
    echo_gate: bool = True
    # On: the gate also runs the microphone through WebRTC's echo canceller (the `aec` extra),
    # the playout as its far end, and takes a window the canceller takes 24 dB from for echo;
    # the VAD and the audio a turn keeps stay on the microphone's own sound. The gate's own
    # waveform comparison already keeps a -6 dB echo (-12 dB on the phone) from pausing the
    # answer, and while no echo path is learnt the canceller's suppressor also damps a person
    # talking over the far end, so an early interruption is silenced later with it than without
    # (`benchmarks/README.md`, turns.py). So it is off by default.
    echo_gate_aec: bool = False
    # Preemptive answers (`preempt.Preempt`): once the person has paused this long mid-turn,
    # the answer to what they said so far is computed and held back; it is released the moment
    # the turn is judged over, or aborted unseen if they go on. None: answers start at the end.
    preemptive_ms: int | None = 160
    # Prefill while speaking: the turn's audio so far is sent to be prefilled (the audio encoder
    # and the thinker keep it for the answer) when speech starts and at every
    # `PREFILL_WINDOW_MS` of it, so that at the turn's end little is left to prefill. Only the
    # audio encoder's whole 8 s windows can be reused exactly, so a short turn gains only its
    # context's prefill (a session's first turn); long ones gain each finished window.
    prefill_while_speaking: bool = False


class TurnPolicy:
    """States: `idle` (nothing paused) and `paused` (speech began over the bot's answer)."""

    def __init__(self, params: TurnParams | None = None, threshold: float = 0.5) -> None:
        self.params = params or TurnParams()
        self.threshold = threshold
        self.paused = False
        self.speech_ms = 0.0  # speech windows since the pause
        self.silence_ms = 0.0  # silence windows in a row since the last speech

    def feed(
        self,
        prob: float,
        event: SpeechStarted | SpeechStopped | None,
        bot_speaking: bool,
        window_ms: float = WINDOW_MS,
    ) -> list[Decision]:
        p = self.params
        if not self.paused:
            if isinstance(event, SpeechStarted) and bot_speaking:
                if p.min_interruption_ms <= 0:
                    return [Decision.BARGE_IN]
                self.paused, self.speech_ms, self.silence_ms = True, window_ms, 0.0
                return [Decision.PAUSE]
            return []
        if prob >= self.threshold:
            self.speech_ms += window_ms
            self.silence_ms = 0.0
        elif prob < self.threshold - ServerVad.HYSTERESIS:
            self.silence_ms += window_ms
        if self.speech_ms >= p.min_interruption_ms:
            self.paused = False
            return [Decision.BARGE_IN]
        if self.silence_ms >= p.resume_after_ms or isinstance(event, SpeechStopped):
            self.paused = False
            return [Decision.RESUME, Decision.DISCARD]
        return []

    def reset(self) -> None:
        self.paused = False
        self.speech_ms = self.silence_ms = 0.0
