"""One conversation with one person, whatever the transport.

    session = Session(coord, output_rate_hz=48000)   # None: follow the session's output format
    await session.start()                 # takes its VAD stream, starts tasks
    session.push_audio(pcm, rate_hz)      # microphone audio, any rate, float32 [-1, 1] or int16
    session.set_video_frame(rgb)          # latest camera frame, uint8 [H, W, 3], or None
    frame = session.read_output(960)      # exactly n samples at `output_rate`, silence if none
    await session.handle(event)           # an OpenAI Realtime client event (a parsed JSON dict)
    err = await session.handle_text(raw, max_bytes)  # the same from JSON text; an error to send
    event = await session.next_event()    # OpenAI Realtime server events, GA names, in order
    await session.close()                 # aborts what is running; safe to call twice

Audio in: `push_audio` never blocks; it resamples to 16 kHz, appends to the input buffer and wakes
the VAD task (silero on 32 ms windows, judged with every other session's in a worker thread). With
server VAD on (the default; `turn_detection: null` in `session.update` turns it off) a speech stop
commits the turn and, with `create_response`, starts a response; otherwise the client commits
(`input_audio_buffer.commit`) and asks (`response.create`).

Audio out: a transport reads at its own clock. A WebRTC track calls `read_output(960)` every
20 ms at 48 kHz and sends what it gets (silence when nothing is queued). The WebSocket sender
calls `read_output(n, pad=False)` as real time allows and sends what comes as audio deltas; a
`Read` also says which response item each sample belongs to. `output_rate` is fixed when given
to the constructor, else it follows `session.update`'s output format between responses.

Events out: `next_event()` returns dicts shaped as the OpenAI GA protocol (`type` plus fields,
no `event_id` yet: the transport adds it). Audio deltas are not among them: the transport makes
those from what it reads. `response.done` comes after the response's audio has been read out,
so a transport that sends audio as it reads it sends every delta before the `response.done`.

A response is active from `response.created` until `response.done`, its playout included. Speech
starting while one is active (with `interrupt_response`) is a barge-in: the playout queue is
flushed at once (the next read is silence), the request is aborted in every stage and awaited,
the assistant item is cut to what was heard (`conversation.item.truncated` says so), and
`response.done` says cancelled / turn_detected: so too when only its audio was left to play.
A response holds its request's output stream unread while the playout queue is `max_lead_ms`
ahead; the runtime's credits then hold back the stages upstream.

`handle` raises `ProtocolError` for an event it refuses; the transport turns it into an `error`
event. Everything here runs in one asyncio loop; no method is thread-safe.

Inside, `Session` is the driver: it owns the tasks, the clock, the pipeline, the playout and the
event channel, and carries out what its parts decide. Every turn decision (speech start and
stop, the end-of-turn model, the echo gate, speech over the answer, the idle timeout) is made by
`turns/taking.py`'s `TurnTaker`, which this driver feeds with window probabilities and times.
What a client event does is decided by `client_events.ClientEvents` (no I/O: the event, this
session as a read-only `View` and the time in; effects out, which `_do` carries out in order).
The responses' lifecycle is `responses.Responses` (one response's state and the events it
makes: `response.Response`, no asyncio), the input transcriptions `transcribe.Transcriptions`:
the two run the session's requests, so they hold it, and own only their own state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from realtime_omni.errors import OmniError
from realtime_omni.gateway.media.audio import INPUT_RATE_HZ
from realtime_omni.gateway.media.echo_canceller import EchoCanceller
from realtime_omni.gateway.media.echo_path import EchoPath
from realtime_omni.gateway.media.input_buffer import AudioCredit, InputBuffer
from realtime_omni.gateway.media.playout import Playout, Read
from realtime_omni.gateway.protocol.conversation import MAX_BYTES, Conversation, Item, Part, new_id
from realtime_omni.gateway.protocol.events import (
    ProtocolError,
)
from realtime_omni.gateway.protocol.session_update import apply_session_update
from realtime_omni.gateway.protocol.settings import SESSION_TYPES, Settings, Voices, new_settings
from realtime_omni.gateway.session import effects
from realtime_omni.gateway.session.client_events import ClientEvents, error
from realtime_omni.gateway.session.hearing import Hearing, VadModel
from realtime_omni.gateway.session.outbox import Outbox
from realtime_omni.gateway.session.response import Response
from realtime_omni.gateway.session.responses import Responses
from realtime_omni.gateway.session.transcribe import Transcriptions
from realtime_omni.gateway.turns.end_of_turn import Ask
from realtime_omni.gateway.turns.taking import (
    Abandon,
    Action,
    AskEndOfTurn,
    BargeIn,
    Discard,
    IdleTimeout,
    Pause,
    Prefill,
    Resume,
    Speculate,
    SpeechStart,
    TurnEnd,
    TurnTaker,
)
from realtime_omni.gateway.turns.vad import WINDOW_SAMPLES
from realtime_omni.logs import SESSION

log = logging.getLogger(__name__)

_METRIC_LEN = 1000  # samples kept per metric


class EndOfTurnModel(Protocol):
    """`end_of_turn.SmartTurn`: P(the turn is complete) for a turn's 16 kHz audio."""

    async def complete(self, audio: np.ndarray) -> float: ...


class Pipeline(Protocol):
    """What a session needs of `Coordinator`."""

    async def submit(self, payload: dict[str, Any], request_id: str | None = None) -> Any:
        """A `RequestStream`: outputs to iterate, and `close()` once done with it."""
        ...

    async def abort(self, request_id: str) -> None: ...


class Session:
    def __init__(
        self,
        coord: Pipeline,
        *,
        vad_factory: Callable[[], VadModel] | None = None,
        end_of_turn: EndOfTurnModel | None = None,
        settings: Settings | None = None,
        output_rate_hz: int | None = None,
        max_lead_ms: float = 2000.0,
        max_payload_bytes: int | None = None,
        max_session_bytes: int = MAX_BYTES,
        on_metric: Callable[[str, float], None] | None = None,
        transport: str = "websocket",
        voices: Voices | None = None,
    ) -> None:
        self.coord = coord
        self.voices = voices or Voices()  # the voice names session.update takes
        self.transport = transport  # where the call came in: websocket, webrtc, twilio, sip...
        # Who started it (`auth.Grant.owner`): a client secret's cap counts its sessions, and
        # only the same owner (or an API key) may hang it up, attach a sideband or evict it.
        self.owner = "open"
        # What the person has heard of an item, in ms, where the transport knows better than
        # what was read out (a phone provider's marks); a barge-in keeps that much.
        self.heard_ms: Callable[[str], int] | None = None
        # Called when queued audio is dropped (barge-in, cancel, clear), so a transport with a
        # buffer of its own downstream (a phone provider's) can flush that too, at once.
        self.on_flush: Callable[[], None] | None = None
        # Called when the answer pauses (speech over it): such a transport drops its downstream
        # buffer too and gives back what was not heard (`playout.unread`), so a resume loses
        # nothing.
        self.on_pause: Callable[[], None] | None = None
        self.on_metric = on_metric  # each measurement as it is made (Prometheus histograms)
        self.id = new_id("sess")
        self._settings = settings or Settings()
        self._fixed_rate = output_rate_hz
        self.max_lead_ms = max_lead_ms
        self.max_payload_bytes = max_payload_bytes
        self.max_session_bytes = max_session_bytes  # what the session may hold, in all
        self.conversation = Conversation(max_bytes=max_session_bytes)
        self.playout = Playout(output_rate_hz or self.settings.output_format.rate_hz)
        self.metrics: dict[str, deque[float]] = {
            k: deque(maxlen=_METRIC_LEN)
            for k in (
                "token_to_audio_ms",
                "first_audio_ms",
                "barge_in_to_silence_ms",
                "abort_ms",
                "answer_compute_ms",  # what each answer's request cost the stages, in all
                "discarded_compute_ms",  # the same, of each preemptive answer abandoned
                "prefill_compute_ms",  # the same, of each prefill while speaking
            )
        }
        self.outbox = Outbox()  # the server events, to the transport and its listeners
        self.audio_written = asyncio.Event()  # set on every playout write; a sender may clear it
        self._vad_factory = vad_factory
        self._eot_model = end_of_turn  # semantic_vad's end-of-turn model; None: silence only
        # Every turn decision: the VAD's, the end-of-turn model's, the echo gate's, speech over
        # the answer, the idle timeout. This driver runs the models and carries them out.
        self.turns = TurnTaker(self._settings.turn_detection, semantic=end_of_turn is not None)
        self.echo = EchoPath()  # the cancellers, and the far end they and the gate hear
        self.hearing = Hearing()  # the input's windows and the VAD's verdicts on them
        self._vad_task: asyncio.Task[None] | None = None
        self.input = InputBuffer()
        self.responses = Responses(self)
        self.transcriptions = Transcriptions(self)
        # Seconds of audio any transport may still push: a burst, then MAX_INPUT_SPEED x real
        # time (`push_audio`); an append pays before it is decoded (`ClientEvents`).
        self.audio_credit = AudioCredit()
        self.audio_dropped_s = 0.0  # what `push_audio` dropped past the credit
        self.client = ClientEvents(self.audio_credit)  # what each client event does
        self.aec_available = EchoCanceller.available()
        # Set on every read of the playout and every flush: a response waiting for room under
        # its lead limit, or for its audio to be heard, looks again.
        self.audio_read = asyncio.Event()
        self._barge_at: float | None = None  # when a barge-in flushed the queue
        self._video: np.ndarray | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._idle: asyncio.TimerHandle | None = None  # `turns.idle_deadline`'s timer
        self._closed = False

    # ---- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        SESSION.set(self.id)  # in the tasks made here and in the caller's from now on
        if self._vad_factory is not None and self.hearing.model is None:
            self.hearing.model = self._vad_factory()
        if self._vad_task is None:
            self._vad_task = asyncio.create_task(self._vad_loop())
        self._set_echo_cancellation()

    def _set_echo_cancellation(self) -> None:
        """WebRTC's audio processing on the microphone, as the settings want it: echo
        cancellation, noise suppression (`noise_reduction`), both or neither; without it, the
        echo gate may still listen through a canceller of its own."""
        td = self.settings.turn_detection
        turns = td.turns if td is not None else None
        listens = turns is not None and turns.echo_gate and turns.echo_gate_aec
        echo, noise = self.settings.echo_cancellation, self.settings.noise_reduction is not None
        if self.echo.configure(echo, noise, listens):  # the VAD's windows change shape
            self.hearing.reshape()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._disarm_idle()
        discard = self.responses.abandon()
        with contextlib.suppress(OmniError):
            await self.cancel_response("client_cancelled")
            if discard is not None:
                await discard  # its abort, before the session's tasks are cancelled
        for t in [self._vad_task, *self._tasks]:
            if t is not None:
                t.cancel()
        await asyncio.gather(
            *(t for t in [self._vad_task, *self._tasks] if t), return_exceptions=True
        )

    @property
    def settings(self) -> Settings:
        """The session object as it stands (`configure` applies a client's changes)."""
        return self._settings

    @settings.setter
    def settings(self, value: Settings) -> None:
        self._settings = value
        self.turns.detection = value.turn_detection  # its rules take effect at the next clear

    @property
    def output_rate(self) -> int:
        return self.playout.rate_hz

    def response_of(self, item_id: str) -> str | None:
        return self.responses.item_response.get(item_id)

    @property
    def input_speaking(self) -> bool:
        """The VAD hears the person speaking now."""
        return self.turns.speaking

    @property
    def active_response(self) -> str | None:
        return self.responses.active.id if self.responses.active else None

    @property
    def responding(self) -> Response | None:
        return self.responses.active

    @property
    def last_response_id(self) -> str | None:
        return self.responses.last_id

    @property
    def turn_item_id(self) -> str | None:
        return self.turns.turn_item_id

    async def handle(self, event: Any) -> None:
        """Apply one client event. Raises `ProtocolError` for one it refuses."""
        for effect in self.client.decide(event, self, time.monotonic()):
            await effects.carry_out(self, effect)

    async def handle_text(self, raw: str, max_bytes: int) -> dict[str, Any] | None:
        """`handle` one client message as a transport receives it (JSON text); the `error`
        event to send back when it is too big, not JSON, refused or failed, else None."""
        return await effects.handle_text(self, raw, max_bytes)

    def configure(self, session: Any) -> list[ProtocolError]:
        """Apply a session object (a client secret's, a call's, a `session.update`'s) without a
        word to the client; the fields refused. An object naming the other session `type`
        (`transcription`) makes this session that type: only a transport that just admitted
        the session, before `start`, configures it."""
        base = self.settings
        kind = session.get("type") if isinstance(session, dict) else None
        if kind in SESSION_TYPES and kind != base.type:
            base = new_settings(kind, base.model)
        s, refused = apply_session_update(base, session, self.voices, self.aec_available)
        self._apply(s)
        return refused

    def _apply(self, s: Settings) -> None:
        changed = s.turn_detection != self.settings.turn_detection
        self.settings = s
        if changed:
            self.turns.configure(s.turn_detection)
            self._clear_input()
        self._set_echo_cancellation()

    def reserve_bytes(self, n: int) -> int:
        """Take `n` of the session's `max_session_bytes` for a transport's own buffer of it
        (the resume replay): from now the conversation holds that much less. Returns `n`."""
        self.conversation.max_bytes -= n
        return n

    async def cancel_response(self, reason: str) -> bool:
        """Stop the active response: flush its audio, abort its request in every stage
        (awaited), keep what was played. False when there was none."""
        return await self.responses.cancel(reason)

    # ---- events ------------------------------------------------------------------------

    def _metric(self, name: str, value_ms: float) -> None:
        # A name not above is one per stage (`transcription_compute_ms.<stage>`): a few more.
        self.metrics.setdefault(name, deque(maxlen=_METRIC_LEN)).append(value_ms)
        if self.on_metric is not None:
            self.on_metric(name, value_ms)

    def _emit(self, kind: str, **fields: Any) -> None:
        self.outbox.send([{"type": kind, **fields}])

    def _send(self, events: list[dict[str, Any]]) -> None:
        """Server events, in order, to the transport and every listener."""
        self.outbox.send(events)

    def subscribe(self, limit: int = 10000) -> asyncio.Queue[dict[str, Any] | None]:
        """A copy of every event from now on (a call's sideband connection), until
        `unsubscribe`; None in it: the listener fell `limit` events behind and was dropped."""
        return self.outbox.subscribe(limit)

    def unsubscribe(self, q: asyncio.Queue[dict[str, Any] | None]) -> None:
        self.outbox.unsubscribe(q)

    async def next_event(self) -> dict[str, Any]:
        return await self.outbox.next()

    def pending_events(self) -> list[dict[str, Any]]:
        return self.outbox.pending()

    # ---- audio in ----------------------------------------------------------------------

    def push_audio(self, pcm: np.ndarray, rate_hz: int, *, paid: bool = False) -> bool:
        """Hear `pcm`, charged to `audio_credit` unless `paid` (its sender took the credit
        before decoding it); audio past the credit is dropped (False), so that no transport
        (a phone stream's burst of media, WebRTC's concealment of a gap) makes a session hear
        faster than real time beyond the credit's burst."""
        if not paid and not self.audio_credit.take(len(pcm) / rate_hz, time.monotonic()):
            self.audio_dropped_s += len(pcm) / rate_hz
            return False
        x = self.input.push(pcm, rate_hz, self.echo.near())
        if len(x) and self.settings.turn_detection is not None:
            self.hearing.push(self.echo.beside(x), self.input.end, time.monotonic())
        return True

    def _clear_input(self) -> None:
        self.responses.abandon()  # an answer held for the turn that is dropped
        self.input.clear()
        self.hearing.reset(self.input.end)
        self.turns.clear(self.input.end * 1000 / INPUT_RATE_HZ)
        self.playout.paused = False

    async def _vad_loop(self) -> None:
        while True:
            if not await self.hearing.wait(
                self.turns.resume_after_s if self.turns.paused else None
            ):
                # Paused over speech, and the client sends no more audio.
                self._carry_out(self.turns.quiet(self.responses.active is not None))
                continue
            if self.settings.turn_detection is None:  # turned off since: its audio was dropped
                continue
            judged = False
            async for part in self.hearing.judge():
                judged = True
                for w in part:
                    self._on_window(w.prob, w.mic, w.arrived, w.clean)
            td = self.settings.turn_detection
            if judged and td is not None and not self.turns.speaking:
                pad = td.vad.prefix_padding_ms * INPUT_RATE_HZ // 1000
                self.input.trim(self.hearing.judged - pad - WINDOW_SAMPLES)

    def _on_window(
        self,
        prob: float,
        window: np.ndarray | None = None,
        t: float = 0.0,
        clean: np.ndarray | None = None,
    ) -> None:
        """One VAD window's speech probability (its audio, its arrival time and what the gate's
        echo canceller leaves of it, where there are): what the turn-taker decides is done."""
        responding = self.responses.active is not None
        self._carry_out(self.turns.window(prob, responding, window, t, clean))

    def _carry_out(self, actions: list[Action]) -> None:
        """Do what the turn-taker decided, in order."""
        for a in actions:
            if isinstance(a, (Pause, Resume, BargeIn, Discard)):
                path = self.turns.gate.path
                log.debug(
                    "session %s: speech over the answer: %s (echo path %s, lag %s windows)",
                    self.id, type(a).__name__, "learnt" if path is not None else "unknown",
                    None if path is None else int(np.argmax(path)),
                )  # fmt: skip
            if isinstance(a, SpeechStart):
                self._disarm_idle()
                self._emit(
                    "input_audio_buffer.speech_started",
                    audio_start_ms=a.audio_start_ms,
                    item_id=a.item_id,
                )
            elif isinstance(a, TurnEnd):
                self._end_turn(a)
            elif isinstance(a, AskEndOfTurn):
                start = a.audio_start_ms * INPUT_RATE_HZ // 1000
                end = int(a.audio_end_ms * INPUT_RATE_HZ / 1000)  # what the VAD has judged
                self._track(self._judge_end_of_turn(a.ask, self.input.slice(start, end)))
            elif isinstance(a, Pause):
                self.playout.paused = True  # the next frame out is silent; nothing is lost
                self._barge_at = time.monotonic()
                if self.on_pause is not None:
                    self.on_pause()
            elif isinstance(a, Resume):
                self.playout.paused = False
                self.audio_written.set()  # a sender waiting for audio: there is some again
            elif isinstance(a, BargeIn):
                if not self.playout.paused:  # else the pause silenced it already, and was timed
                    self._barge_at = time.monotonic()
                self.playout.paused = False  # the next answer plays; this one is flushed
                self.responses.barge_in()
            elif isinstance(a, Discard):
                self._emit(
                    "input_audio_buffer.speech_stopped",
                    audio_end_ms=a.audio_end_ms,
                    item_id=a.item_id,
                )
                self._clear_input()
                self._emit("input_audio_buffer.cleared")
            elif isinstance(a, IdleTimeout):
                self._idle_timeout()
            elif isinstance(a, Speculate):
                start = a.audio_start_ms * INPUT_RATE_HZ // 1000
                pcm = self.input.slice(start, a.audio_end_ms * INPUT_RATE_HZ // 1000)
                turn = Item(a.item_id, "user", [Part("audio", audio=pcm)])
                if not self.responses.speculate(turn, time.monotonic()):
                    self.turns.held_end_ms = None  # none is computed: the turn ends as usual
            elif isinstance(a, Abandon):
                self.responses.abandon()
            elif isinstance(a, Prefill):
                start = a.audio_start_ms * INPUT_RATE_HZ // 1000
                pcm = self.input.slice(start, a.audio_end_ms * INPUT_RATE_HZ // 1000)
                self.responses.prefill(Item(a.item_id, "user", [Part("audio", audio=pcm)]))

    async def _judge_end_of_turn(self, ask: Ask, audio: np.ndarray) -> None:
        """The speech paused: if the end-of-turn model hears the turn complete, it ends now."""
        assert self._eot_model is not None
        try:
            p = await self._eot_model.complete(audio)
        except Exception:
            log.exception("session %s: the end-of-turn model failed; silence decides", self.id)
            return
        log.debug("session %s: end of turn? p=%.2f", self.id, p)
        self._carry_out(self.turns.end_of_turn(ask, p))

    # ---- idle timeout ------------------------------------------------------------------

    def _arm_idle(self) -> None:
        """An answer has been heard: with `idle_timeout_ms`, silence that long from now asks the
        model to go on (OpenAI's server_vad idle timeout, for a caller gone quiet)."""
        self._disarm_idle()
        if self._closed:
            return
        now = time.monotonic()
        deadline = self.turns.answered(now)
        if deadline is not None:
            loop = asyncio.get_running_loop()
            self._idle = loop.call_later(deadline - now, self._on_idle, deadline)

    def _disarm_idle(self) -> None:
        self.turns.cancel_idle()
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def _on_idle(self, deadline: float) -> None:
        self._idle = None
        if not self._closed:
            self._carry_out(self.turns.idle(deadline, self.responses.active is not None))

    def _idle_timeout(self) -> None:
        start, end = self.input.start, self.input.end
        pcm = self.input.slice(start, end)
        item_id = new_id("item")
        self._clear_input()
        self._emit(
            "input_audio_buffer.timeout_triggered",
            audio_start_ms=start * 1000 // INPUT_RATE_HZ,
            audio_end_ms=end * 1000 // INPUT_RATE_HZ,
            item_id=item_id,
        )
        if len(pcm):  # what the microphone heard meanwhile (silence, or what VAD ignored)
            self._commit_audio(pcm, item_id)
        with contextlib.suppress(ProtocolError):  # the conversation too large: no answer
            self.responses.start({}, time.monotonic())

    def _end_turn(self, turn: TurnEnd) -> None:
        """A turn ended: its audio becomes a user item and, if asked, gets an answer."""
        self._emit(
            "input_audio_buffer.speech_stopped",
            audio_end_ms=turn.audio_end_ms,
            item_id=turn.item_id,
        )
        start = turn.audio_start_ms * INPUT_RATE_HZ // 1000
        end = turn.audio_end_ms * INPUT_RATE_HZ // 1000
        # A held answer heard the turn up to its pause: the turn is that audio (the silence
        # after it is nobody's words), so the answer released is the one it would start now.
        kept = end if turn.held_end_ms is None else turn.held_end_ms * INPUT_RATE_HZ // 1000
        pcm = self.input.slice(start, kept)
        self.input.trim(end)
        self._commit_audio(pcm, turn.item_id)
        if turn.held_end_ms is not None and self.responses.release(turn.item_id, time.monotonic()):
            return
        self.responses.abandon()
        if turn.respond and self.responses.active is None:
            try:
                self.responses.start({}, time.monotonic())
            except ProtocolError as e:  # no client event to answer: tell it all the same
                self.outbox.send([error(e)])

    def _add(self, item: Item, previous_item_id: str | None = None) -> str | None:
        """Add to the conversation; announce what its bounds dropped to make room."""
        prev = self.conversation.add(item, previous_item_id)
        self._announce_dropped()
        return prev

    def _announce_dropped(self) -> None:
        """Tell the client of every item the conversation's bounds or truncation deleted."""
        for item_id in self.conversation.take_dropped():
            self._deleted(item_id)

    def _deleted(self, item_id: str) -> None:
        """An item left the conversation: nothing of the session works on it any longer (its
        transcription is cancelled, releasing its audio), and the client is told."""
        self.responses.item_response.pop(item_id, None)
        self.transcriptions.cancel(item_id)
        self._emit("conversation.item.deleted", item_id=item_id)

    def _commit_audio(self, pcm: np.ndarray, item_id: str) -> None:
        item = Item(item_id, "user", [Part("audio", audio=pcm)])
        prev = self._add(item)
        self._emit("input_audio_buffer.committed", previous_item_id=prev, item_id=item_id)
        self._emit_item_added(item, prev)
        self.transcriptions.later(item)

    def _emit_item_added(self, item: Item, prev: str | None) -> None:
        self._emit("conversation.item.added", previous_item_id=prev, item=item.to_openai())
        self._emit("conversation.item.done", previous_item_id=prev, item=item.to_openai())

    # ---- audio out ---------------------------------------------------------------------

    def read_output(self, n: int, pad: bool = True) -> Read:
        """Take the next `n` samples at `output_rate` (fewer without `pad`)."""
        r = self.playout.read(n, pad)
        self.audio_read.set()
        now = time.monotonic()
        self.echo.heard(
            r, self.playout.rate_hz, self.turns.gate if self.turns.gating else None, now
        )
        if self._barge_at is not None:
            self._metric("barge_in_to_silence_ms", (now - self._barge_at) * 1e3)
            self._barge_at = None
        resp = self.responses.active
        for cs in r.chunk_starts:
            first = resp is not None and cs.item_id == resp.item.id and resp.first_audio is None
            if first and resp is not None:
                resp.first_audio = now
                self.responses.audible.set()
                self._metric("first_audio_ms", (now - resp.turn_end) * 1e3)
            if first or cs.queue_was_empty:
                self._metric("token_to_audio_ms", (now - cs.token_time) * 1e3)
        return r

    def _flush(self, item_id: str | None = None) -> None:
        """Drop what is queued (of one item, or all) and tell the transport."""
        self.playout.clear(item_id)
        self.audio_read.set()
        if self.on_flush is not None:
            self.on_flush()

    def _track(self, coro: Any) -> asyncio.Task[Any]:
        """Run `coro` as a task of this session (`close` cancels it); its failure is logged."""
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._task_done)
        return t

    def _task_done(self, t: asyncio.Task[Any]) -> None:
        self._tasks.discard(t)
        if not t.cancelled() and (e := t.exception()) is not None:
            log.error("session %s: %s", self.id, e, exc_info=not isinstance(e, OmniError))

    # ---- camera ------------------------------------------------------------------------

    def set_video_frame(self, frame: np.ndarray | None) -> None:
        """The latest camera frame (uint8 [H, W, 3]); the next turn carries it as an image."""
        if frame is not None:
            frame = np.ascontiguousarray(frame, np.uint8)
            if frame.ndim != 3 or frame.shape[2] != 3:
                raise ValueError(f"a video frame must be uint8 [H, W, 3], got {frame.shape}")
        self._video = frame

    def dtmf(self, digit: str) -> None:
        """A key the caller pressed (a phone bridge's `dtmf`, SIP's RFC 4733 events), announced
        as OpenAI's SIP calls announce it; a controlling client decides what it means."""
        self._emit(
            "input_audio_buffer.dtmf_event_received", event=digit, received_at=int(time.time())
        )
