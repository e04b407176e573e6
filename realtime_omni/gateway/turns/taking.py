"""Turn-taking, decided in one place: when speech starts and a turn ends, what speech over the
bot's answer means, when the end-of-turn model is asked and when its answer ends a turn, the
echo gate's verdict and the idle timeout. No I/O, no asyncio, no torch.

    taker = TurnTaker(settings.turn_detection, semantic=model is not None)
    for prob in probabilities:                      # one per 32 ms window of the microphone
        for action in taker.window(prob, responding=answer_active):
            ...                                     # the session carries each one out

Time comes in as arguments and what to do comes out as actions, in the order they are to be
carried out. The session (`gateway/session/driver.py`) runs the VAD model, keeps the timers, the
input buffer and the playout, and does what the actions say:

| action | the caller |
|---|---|
| `SpeechStart` | announces `input_audio_buffer.speech_started` |
| `TurnEnd` | announces the stop, commits the turn's audio and, with `respond`, answers it |
| `Discard` | announces the stop, clears its input and calls `clear` (no turn) |
| `Pause` / `Resume` | silences the answer from the next frame / plays it on |
| `BargeIn` | flushes the answer's audio and cancels it |
| `AskEndOfTurn` | runs the end-of-turn model on the turn's audio, then calls `end_of_turn` |
| `IdleTimeout` | commits what the microphone heard and asks for an answer |
| `Speculate` | starts the answer to the turn so far, held back (nothing sent) |
| `Abandon` | aborts the held answer, sends nothing |
| `Prefill` | sends the turn so far to be prefilled (no answer, nothing sent to the client) |

The rules themselves live in the plain machines this one drives: `vad.ServerVad` (OpenAI's
`server_vad`), `end_of_turn.EndOfTurn` (`semantic_vad`), `policy.TurnPolicy` (speech over the
bot), `echo.EchoGate` (the bot's own voice coming back) and `preempt.Preempt` (answers computed
from a pause on, shown once the turn ends).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from realtime_omni.gateway.protocol.conversation import new_id
from realtime_omni.gateway.protocol.settings import TurnDetection
from realtime_omni.gateway.turns.echo import EchoGate
from realtime_omni.gateway.turns.end_of_turn import SEMANTIC_TIMEOUT_MS, Ask, EndOfTurn
from realtime_omni.gateway.turns.policy import Decision, TurnParams, TurnPolicy
from realtime_omni.gateway.turns.preempt import Preempt
from realtime_omni.gateway.turns.vad import ServerVad, SpeechStarted, SpeechStopped, VadParams


@dataclass(frozen=True)
class SpeechStart:
    item_id: str  # the user item the speech becomes, if it becomes a turn
    audio_start_ms: int  # where the turn's audio begins (padding included)


@dataclass(frozen=True)
class TurnEnd:
    item_id: str
    audio_start_ms: int  # the turn's audio: [start, end) of the input, in ms of input audio
    audio_end_ms: int
    respond: bool  # `create_response`: answer it (when no answer is active)
    # An answer to the turn up to here was computed at its last pause and held (`Speculate`):
    # the turn keeps its audio up to here (the silence after is not the person's) and that
    # answer is released. None: none is held.
    held_end_ms: int | None = None


@dataclass(frozen=True)
class Speculate:
    """The person paused (`preemptive_ms` of silence): compute the answer to the turn so far
    and hold it back, sending nothing, until the turn ends or they go on."""

    item_id: str
    audio_start_ms: int
    audio_end_ms: int


@dataclass(frozen=True)
class Prefill:
    """The turn so far may be prefilled (`prefill_while_speaking`): its speech started, or
    another of the audio encoder's windows of it is whole."""

    item_id: str
    audio_start_ms: int
    audio_end_ms: int


@dataclass(frozen=True)
class Abandon:
    """The person went on talking after a `Speculate`: abort its answer, send nothing."""


@dataclass(frozen=True)
class Discard:
    """Speech over the bot that was no interruption: no turn."""

    item_id: str
    audio_end_ms: int


@dataclass(frozen=True)
class Pause:
    """Speech began over the answer: silence it from the next frame, drop nothing."""


@dataclass(frozen=True)
class Resume:
    """The speech over the answer was not an interruption: play on where it paused."""


@dataclass(frozen=True)
class BargeIn:
    """A real interruption: the answer's audio goes now, the answer is cancelled."""


@dataclass(frozen=True)
class AskEndOfTurn:
    ask: Ask  # hand it back to `end_of_turn` with the model's answer
    audio_start_ms: int  # the turn so far: [start, end) of the input, in ms of input audio
    audio_end_ms: float


@dataclass(frozen=True)
class IdleTimeout:
    """No speech for `idle_timeout_ms` after an answer was heard: answer anyway."""


Action = (
    SpeechStart
    | TurnEnd
    | Discard
    | Pause
    | Resume
    | BargeIn
    | AskEndOfTurn
    | IdleTimeout
    | Speculate
    | Abandon
    | Prefill
)
# The audio encoder's attention window (Qwen3-Omni's audio tower: 8 s of audio); an encoding of
# a turn's whole windows is what a longer turn reuses exactly (`models/qwen3_omni/encoders.py`).
PREFILL_WINDOW_MS = 8000


class TurnTaker:
    """One session's turn-taking. `detection` is the session's `turn_detection` (None: the client
    commits turns itself; windows then only move the VAD's clock). `semantic`: an end-of-turn
    model is there to ask, which `semantic_vad` uses."""

    def __init__(self, detection: TurnDetection | None, semantic: bool = False) -> None:
        self.detection = detection
        self.has_model = semantic
        self.vad = ServerVad(self._vad_params())
        # Made once: its speech threshold stays the session's first (as it always was).
        self.eot = EndOfTurn(vad=self.vad.params.threshold)
        self.policy = TurnPolicy(self._turn_params(), self.vad.params.threshold)
        self.gate = EchoGate()  # is the microphone hearing the bot's own audio?
        self.turn_item_id: str | None = None  # the user item a detected speech will become
        self.turn_start_ms = 0
        self.idle_deadline: float | None = None  # when `idle` answers with an IdleTimeout
        self.preempt = self._preempt()  # None: no answer starts before the turn ends
        self.held_end_ms: int | None = None  # a `Speculate`'s, until its answer goes
        self._prefilled_to_ms = 0.0  # the turn's audio a `Prefill` covered

    # ---- what the session reads -------------------------------------------------------

    @property
    def speaking(self) -> bool:
        """The VAD hears the person speaking now."""
        return self.vad.speaking

    @property
    def paused(self) -> bool:
        """Speech began over the answer and is still being judged."""
        return self.policy.paused

    @property
    def resume_after_s(self) -> float:
        """While `paused`, after this long with no audio at all call `quiet`."""
        return self.policy.params.resume_after_ms / 1000

    @property
    def semantic(self) -> bool:
        """semantic_vad with an end-of-turn model: the model may end a turn before the VAD."""
        td = self.detection
        return td is not None and td.eagerness is not None and self.has_model

    @property
    def gating(self) -> bool:
        """The echo gate is on (server VAD with `echo_gate`)."""
        td = self.detection
        return td is not None and td.turns.echo_gate

    def bot_speaking(self, responding: bool) -> bool:
        """An answer is active that speech may interrupt."""
        td = self.detection
        return td is not None and td.interrupt_response and responding

    # ---- what the session tells -------------------------------------------------------

    def configure(self, detection: TurnDetection | None) -> None:
        """New `turn_detection`; the caller clears its input and calls `clear` next."""
        self.detection = detection
        self.vad = ServerVad(self._vad_params())
        self.preempt = self._preempt()

    def clear(self, elapsed_ms: float) -> None:
        """The input was cleared at `elapsed_ms` of input audio: no turn is in progress, the VAD
        starts afresh there, speech over the bot is no longer judged."""
        self.vad = ServerVad(self.vad.params)
        self.vad.elapsed_ms = elapsed_ms
        self.eot.reset()
        self.turn_item_id = None
        self.policy = TurnPolicy(self._turn_params(), self.vad.params.threshold)
        self.preempt = self._preempt()  # a held answer is the caller's to abandon
        self.held_end_ms = None

    def window(
        self,
        prob: float,
        responding: bool,
        mic: np.ndarray | None = None,
        t: float = 0.0,
        clean: np.ndarray | None = None,
    ) -> list[Action]:
        """One 32 ms window's speech probability. `responding`: an answer is active. With the
        window's audio (`mic`, arrived at monotonic time `t`; `clean`, what the gate's echo
        canceller leaves of it, if any) the echo gate may take it for the bot's own voice."""
        if mic is not None and self.gating and self.gate.window(mic, t, clean):
            prob = 0.0  # the bot's own voice coming back: neither speech nor a turn
        ev = self.vad.feed(prob)
        if self.detection is None:
            return []
        out: list[Action] = []
        if self.semantic and (ask := self.eot.feed(prob, ev)) is not None:
            out.append(AskEndOfTurn(ask, self.turn_start_ms, self.vad.elapsed_ms))
        if isinstance(ev, SpeechStarted):
            self.idle_deadline = None
            self.turn_item_id = new_id("item")
            self.turn_start_ms = ev.audio_start_ms
            out.append(SpeechStart(self.turn_item_id, ev.audio_start_ms))
            if self._prefilling(responding):
                self._prefilled_to_ms = self.vad.elapsed_ms
                out.append(Prefill(self.turn_item_id, ev.audio_start_ms, ev.detected_ms))
        elif self.vad.speaking and self.turn_item_id is not None and self._prefilling(responding):
            done = (self.vad.elapsed_ms - self.turn_start_ms) // PREFILL_WINDOW_MS
            if done > (self._prefilled_to_ms - self.turn_start_ms) // PREFILL_WINDOW_MS:
                self._prefilled_to_ms = self.vad.elapsed_ms
                end = round(self.vad.elapsed_ms)
                out.append(Prefill(self.turn_item_id, self.turn_start_ms, end))
        speaking = self.bot_speaking(responding)
        if speaking or self.policy.paused:
            decided = self._decided(self.policy.feed(prob, ev, speaking))
            out += decided
            if decided and isinstance(decided[-1], Discard):
                return out  # a discarded blip: its stop, if the VAD saw one, is no turn
        if self.preempt is not None:
            verdict = self.preempt.feed(prob, ev, free=not responding)
            if verdict == "speculate" and self.turn_item_id is not None:
                self.held_end_ms = round(self.vad.elapsed_ms)
                out.append(Speculate(self.turn_item_id, self.turn_start_ms, self.held_end_ms))
            elif verdict == "abandon":
                self.held_end_ms = None
                out.append(Abandon())
        if isinstance(ev, SpeechStopped):
            out.append(self._turn_end(ev))
        return out

    def quiet(self, responding: bool) -> list[Action]:
        """While `paused`, no audio came for `resume_after_s`: the policy hears that much
        silence (the VAD does not: its clock is the audio's)."""
        out: list[Action] = []
        while self.policy.paused:
            out += self._decided(self.policy.feed(0.0, None, self.bot_speaking(responding)))
        return out

    def end_of_turn(self, ask: Ask, p_complete: float) -> list[Action]:
        """The end-of-turn model's answer to `ask`: the turn may end now."""
        if self.eot.answer(ask, p_complete) and self.vad.speaking and not self.policy.paused:
            self.eot.reset()
            stop = self.vad.stop()
            if self.preempt is not None:
                self.preempt.feed(0.0, stop, free=False)  # the turn is over: nothing to abandon
            return [self._turn_end(stop)]
        return []

    def truncated(self) -> bool:
        """The client cut the answer while speech over it was being judged (OpenAI's clients do,
        at speech_started): it took the speech for an interruption, so the speech goes on as
        the next turn instead of being judged a blip. True when it was being judged."""
        if not self.policy.paused:
            return False
        self.policy.reset()
        return True

    def answered(self, now: float) -> float | None:
        """An answer ended at `now`: with `idle_timeout_ms`, the deadline at which `idle` asks
        the model to go on (a caller gone quiet); None without."""
        td = self.detection
        self.idle_deadline = now + td.idle_timeout_ms / 1000 if td and td.idle_timeout_ms else None
        return self.idle_deadline

    def cancel_idle(self) -> None:
        """An answer started: no idle timeout until it ends."""
        self.idle_deadline = None

    def idle(self, now: float, responding: bool) -> list[Action]:
        """The idle timer fired at `now`."""
        if self.idle_deadline is None or now < self.idle_deadline:
            return []
        self.idle_deadline = None
        if responding or self.vad.speaking:
            return []
        return [IdleTimeout()]

    # ---- inside ------------------------------------------------------------------------

    def _decided(self, decisions: list[Decision]) -> list[Action]:
        out: list[Action] = []
        for d in decisions:
            if d is Decision.PAUSE:
                out.append(Pause())
            elif d is Decision.RESUME:
                out.append(Resume())
            elif d is Decision.BARGE_IN:
                out.append(BargeIn())
            elif d is Decision.DISCARD:
                item_id = self.turn_item_id or new_id("item")
                out.append(Discard(item_id, round(self.vad.elapsed_ms)))
                break
        return out

    def _turn_end(self, ev: SpeechStopped) -> TurnEnd:
        td = self.detection
        assert td is not None
        item_id = self.turn_item_id or new_id("item")
        self.turn_item_id = None
        held, self.held_end_ms = self.held_end_ms, None
        return TurnEnd(item_id, self.turn_start_ms, ev.audio_end_ms, td.create_response, held)

    def _prefilling(self, responding: bool) -> bool:
        td = self.detection
        return td is not None and td.turns.prefill_while_speaking and not responding

    def _preempt(self) -> Preempt | None:
        td = self.detection
        if td is None or td.turns.preemptive_ms is None or not td.create_response:
            return None
        return Preempt(td.turns.preemptive_ms, td.vad.threshold)

    def _vad_params(self) -> VadParams | None:
        """The VAD's rules: the session's, with semantic_vad's longest silence where an
        end-of-turn model decides before it."""
        td = self.detection
        if td is None:
            return None
        if self.semantic:
            assert td.eagerness is not None
            return replace(td.vad, silence_duration_ms=SEMANTIC_TIMEOUT_MS[td.eagerness])
        return td.vad

    def _turn_params(self) -> TurnParams | None:
        td = self.detection
        return td.turns if td is not None else None
