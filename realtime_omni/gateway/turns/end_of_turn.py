"""Semantic end of turn: has the person finished what they were saying? (`semantic_vad`)

    eot = EndOfTurn()
    for prob, vad_event in windows:                       # one per 32 ms VAD window
        if (ask := eot.feed(prob, vad_event)) is not None:
            p = await model.complete(turn_audio)          # Smart Turn, off the event loop
            if eot.answer(ask, p):
                ...                                       # end the turn now

The silence rule (`vad.ServerVad`) ends a turn after a fixed silence, whatever was said. With
`semantic_vad` and an end-of-turn model, the session asks the model once the speech has paused
for `probe_ms`: if the utterance sounds complete, the turn ends then, sooner than any fixed
silence would; if it trails off ("I was thinking that maybe..."), the turn waits on, and the
model is asked again as the silence grows (`REPROBE_MS`): a complete sentence it doubted at
200 ms it hears complete once more silence follows (Smart Turn sees the trailing silence), while
a hesitation ("um", a drawn-out rising word) stays incomplete. Past the last probe the
eagerness' longest silence (OpenAI's 8, 4 and 2 s for low, medium and high) ends the turn, as
the VAD enforces it. Speech that resumes before an answer comes makes it stale, as does a
newer question.

`EndOfTurn` is the decision (no I/O, no model); the model is `models/smart_turn.py`'s
`SmartTurn`.
"""

from __future__ import annotations

from dataclasses import dataclass

from realtime_omni.gateway.turns.vad import WINDOW_MS, ServerVad, SpeechStarted, SpeechStopped

# eagerness -> the longest silence that may follow speech before the turn ends anyway
SEMANTIC_TIMEOUT_MS = {"low": 8000, "medium": 4000, "auto": 4000, "high": 2000}
# The silences after the first probe at which the model is asked again: a question each.
REPROBE_MS = (500.0, 1000.0, 1500.0, 2500.0)


@dataclass(frozen=True)
class Ask:
    """Run the end-of-turn model on the turn so far; answer with this token."""

    token: int


class EndOfTurn:
    """States: `idle` (no turn), `speaking`, `paused` (speech then `probe_ms` of silence: the
    model was asked, and is asked again at each of `reprobe_ms` of silence; a new pause needs
    speech again)."""

    def __init__(
        self,
        probe_ms: float = 200.0,
        threshold: float = 0.5,
        vad: float = 0.5,
        reprobe_ms: tuple[float, ...] = REPROBE_MS,
    ) -> None:
        self.probes = (probe_ms, *(ms for ms in reprobe_ms if ms > probe_ms))
        self.threshold = threshold  # P(complete) above this ends the turn
        self.vad = vad  # the VAD's threshold: what counts as speech and as silence
        self.speaking = False
        self.asked = 0  # questions asked in this pause
        self.silence_ms = 0.0
        self.token = 0  # the current question; an answer to another is stale

    def feed(
        self, prob: float, event: SpeechStarted | SpeechStopped | None, window_ms: float = WINDOW_MS
    ) -> Ask | None:
        if isinstance(event, SpeechStarted):
            self.speaking, self.asked, self.silence_ms = True, 0, 0.0
            return None
        if isinstance(event, SpeechStopped) or not self.speaking:
            self.reset()
            return None
        if prob >= self.vad:
            if self.asked:  # they went on talking: whatever the model says is about less
                self.token += 1
            self.asked, self.silence_ms = 0, 0.0
        elif prob < self.vad - ServerVad.HYSTERESIS:
            self.silence_ms += window_ms
            if self.asked < len(self.probes) and self.silence_ms >= self.probes[self.asked]:
                self.asked += 1
                self.token += 1
                return Ask(self.token)
        return None

    def answer(self, ask: Ask, p_complete: float) -> bool:
        """The model's answer to `ask`: True when the turn ends now."""
        return (
            ask.token == self.token
            and self.asked > 0
            and self.speaking
            and p_complete > self.threshold
        )

    def reset(self) -> None:
        """No turn in progress (it ended, or the input was cleared); stale answers stay so."""
        self.speaking = False
        self.asked = 0
        self.silence_ms = 0.0
        self.token += 1
