"""OpenAI's Live API (full duplex, `/v1/live/sessions`) as a translation to and from the Realtime
protocol the `Session` speaks. No I/O: the transport (`transports/live.py`) feeds it each Live
client event and each session event, and carries out what it returns.

    config = parse_start(event["session"], voices)    # LiveError naming what is refused
    session.configure(config.realtime_session())       # turns stay the server's: VAD, barge-in
    live = LiveProtocol(config)
    step = live.client(event, out_ms)   # a Live client event -> Step: Realtime events to handle,
                                        # audio to push, Live replies, a close
    step = live.server(event, out_ms)   # a session event -> Step: Live events to send (and a
                                        # Realtime event to handle: a deferred response.create)

Times (`start_ms`, `end_ms`, `offset_ms`) are on the session's timeline: milliseconds since
`session.started`. Output is a continuous stream (silence included), so the output side's clock
is the audio sent (`out_ms`); the input side's is the input audio's (the client streams its
microphone continuously, silence included, as both LiveKit and Pipecat do).

Delegation (`client`, the only kind served): the model is given one function, `delegate`; its
call is announced as `session.delegation.created` with the call's id as the delegation's id (and
the model's `request`, an extension field). The client answers with
`session.commentary.append` (spoken: the result goes back as the call's output and the model
answers), `session.thinking.append` (silent: the output, no answer), or as a Responses client
would, `response.item.create` with a `function_call_output` and then `response.create`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from realtime_omni.gateway.media import audio
from realtime_omni.gateway.protocol.conversation import new_id
from realtime_omni.gateway.protocol.events import ProtocolError, decode_b64
from realtime_omni.gateway.protocol.settings import Voices

MAX_INPUT_ITEMS = 128  # startup history, as OpenAI's Live API caps it
MAX_APPEND_CHARS = 8000  # one context append (OpenAI: 500 tokens; no tokenizer here)
DELEGATE = "delegate"
DELEGATE_TOOL: dict[str, Any] = {
    "type": "function",
    "name": DELEGATE,
    "description": (
        "Hand work you cannot do yourself (looking something up, acting for the caller) to the "
        "application. Tell the caller you are on it; the result comes back to you."
    ),
    "parameters": {
        "type": "object",
        "properties": {"request": {"type": "string", "description": "what is needed, in full"}},
        "required": ["request"],
    },
}
START_FIELDS = ("model", "instructions", "input", "audio", "delegation", "store")
CLOSE_REASONS = ("close_requested", "expired", "content", "remote_hangup", "connection_lost")
ROLES = {"user": "user", "assistant": "assistant", "developer": "system"}


class LiveError(ProtocolError):
    """A Live client event refused: an `error` event naming the field; the session goes on
    (at `session.start`, the connection is closed after it)."""


@dataclass(frozen=True)
class LiveFormat:
    """`audio.format`: one format for input and output on a WebSocket."""

    kind: str = "audio/pcm"  # audio/pcm (16 or 24 kHz) | audio/pcmu | audio/pcma (8 kHz)
    rate_hz: int = 24000

    @property
    def sample_bytes(self) -> int:
        return 2 if self.kind == "audio/pcm" else 1

    def decode(self, data: bytes) -> np.ndarray:
        if self.kind == "audio/pcm":
            if len(data) % 2:
                raise LiveError("pcm audio has an odd number of bytes", param="audio")
            return audio.pcm16_to_float(data)
        return audio.ulaw_decode(data) if self.kind == "audio/pcmu" else audio.alaw_decode(data)

    def encode(self, x: np.ndarray) -> bytes:
        if self.kind == "audio/pcm":
            return audio.float_to_pcm16(x)
        return audio.ulaw_encode(x) if self.kind == "audio/pcmu" else audio.alaw_encode(x)

    def to_live(self) -> dict[str, Any]:
        return {"type": self.kind, "rate": self.rate_hz}


@dataclass(frozen=True)
class StartConfig:
    """What `session.start` asked for, checked."""

    model: str
    instructions: str | None = None
    voice: str | None = None
    format: LiveFormat = LiveFormat()
    history: tuple[dict[str, Any], ...] = ()  # the `input` items as given

    def realtime_session(self) -> dict[str, Any]:
        """The Realtime session object the `Session` is configured with: the server's turn
        detection as it stands, input transcription, the one delegation function."""
        audio_: dict[str, Any] = {"input": {"transcription": {}}}
        if self.voice is not None:
            audio_["output"] = {"voice": self.voice}
        out: dict[str, Any] = {"audio": audio_, "tools": [DELEGATE_TOOL], "tool_choice": "auto"}
        if self.instructions is not None:
            out["instructions"] = self.instructions
        return out

    def history_events(self) -> list[dict[str, Any]]:
        """The startup history as Realtime `conversation.item.create` events, in order."""
        out = []
        for it in self.history:
            role = ROLES[it["role"]]
            kind = "output_text" if role == "assistant" else "input_text"
            content = [{"type": kind, "text": p["text"]} for p in it["content"]]
            item = {"type": "message", "role": role, "content": content}
            out.append({"type": "conversation.item.create", "item": item})
        return out

    def to_live(self, session_id: str, expires_at: int) -> dict[str, Any]:
        """The session resource of `session.started`, `session.updated` and `session.closed`
        (whose status is `active` too, as OpenAI's: the event says it closed)."""
        return {
            "id": session_id,
            "object": "live.session",
            "status": "active",
            "expires_at": expires_at,
            "model": self.model,
            "instructions": self.instructions,
            "audio": {"format": self.format.to_live(), "output": {"voice": self.voice}},
            "delegation": {"type": "client"},
            "input": list(self.history),
        }


def _fail(message: str, param: str, code: str = "invalid_value") -> LiveError:
    return LiveError(f"{param}: {message}", code=code, param=param)


def _parse_format(v: Any) -> LiveFormat:
    if not isinstance(v, dict) or set(v) - {"type", "rate"}:
        raise _fail("an object {type, rate}", "session.audio.format")
    kind, rate = v.get("type", "audio/pcm"), v.get("rate")
    if kind == "audio/pcm":
        rate = 24000 if rate is None else rate
        if rate not in (16000, 24000):
            raise _fail(f"rate {rate!r}: audio/pcm is 16000 or 24000", "session.audio.format.rate")
        return LiveFormat(kind, rate)
    if kind in ("audio/pcmu", "audio/pcma"):
        if rate not in (None, 8000):
            raise _fail(f"rate {rate!r}: {kind} is 8000", "session.audio.format.rate")
        return LiveFormat(kind, 8000)
    raise _fail(f"{kind!r}: use audio/pcm, audio/pcmu or audio/pcma", "session.audio.format.type")


def _parse_history(v: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(v, list) or len(v) > MAX_INPUT_ITEMS:
        raise _fail(f"a list of at most {MAX_INPUT_ITEMS} messages", "session.input")
    for i, it in enumerate(v):
        param = f"session.input[{i}]"
        if not isinstance(it, dict) or it.get("type", "message") != "message":
            raise _fail("a message {type, role, content}", param)
        if it.get("role") not in ROLES:
            raise _fail(f"role {it.get('role')!r}: developer, user or assistant", param + ".role")
        content = it.get("content")
        if not isinstance(content, list) or not content:
            raise _fail("a non-empty list of text parts", param + ".content")
        for j, p in enumerate(content):
            ok = isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
            if not ok or not isinstance(p.get("text"), str):
                raise _fail("{type: input_text | output_text, text}", f"{param}.content[{j}]")
    return tuple(v)


def _parse_delegation(v: Any, param: str = "session.delegation") -> None:
    """Client delegation is served; `responses` (a model of OpenAI's to call) is refused."""
    if v is None:
        return
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "responses":
        raise _fail(
            "'responses' delegation is not served: this server runs no Responses model to hand "
            "work to; use {type: client} and answer session.delegation.created yourself",
            param + ".type",
            code="unsupported_delegation",
        )
    if kind != "client" or set(v) - {"type"}:
        raise _fail("{type: client}", param)


def parse_start(session: Any, voices: Voices) -> StartConfig:
    """`session.start`'s `session`, strictly: an unknown field, a voice this server has not, a
    delegation it cannot serve are refused by name."""
    if not isinstance(session, dict):
        raise _fail("an object", "session")
    unknown = sorted(set(session) - set(START_FIELDS))
    if unknown:
        raise _fail(f"unknown field(s) {', '.join(unknown)}", f"session.{unknown[0]}")
    model = session.get("model")
    if not isinstance(model, str) or not model:
        raise _fail("required, a string", "session.model")
    instructions = session.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _fail("a string", "session.instructions")
    if session.get("store"):
        raise _fail("this server keeps no sessions (no recordings, no forks)", "session.store")
    _parse_delegation(session.get("delegation"))
    fmt, voice = LiveFormat(), None
    a = session.get("audio")
    if a is not None:
        if not isinstance(a, dict) or set(a) - {"format", "output"}:
            raise _fail("an object {format, output}", "session.audio")
        if a.get("format") is not None:
            fmt = _parse_format(a["format"])
        out = a.get("output")
        if out is not None:
            if not isinstance(out, dict) or set(out) - {"voice"}:
                raise _fail("an object {voice}", "session.audio.output")
            if out.get("voice") is not None:
                voice = voices.check(out["voice"], "session.audio.output.voice")
    history = _parse_history(session["input"]) if session.get("input") is not None else ()
    return StartConfig(model, instructions, voice, fmt, history)


@dataclass
class Step:
    """What one event asks of the transport, in this order: Realtime client events for
    `Session.handle`, audio for `Session.push_audio`, Live events to send, a close."""

    handle: list[dict[str, Any]] = field(default_factory=list)
    audio: np.ndarray | None = None
    send: list[dict[str, Any]] = field(default_factory=list)
    close: str | None = None  # a session.closed reason: drain, then close


def live_error(e: ProtocolError, client_event_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "code": e.code,
            "message": str(e),
            "param": e.param,
            "client_event_id": client_event_id,
        },
    }


def _content(ev: dict[str, Any]) -> str:
    text = ev.get("content")
    if not isinstance(text, str) or not text.strip():
        raise LiveError("content must be non-empty text", param="content")
    if len(text) > MAX_APPEND_CHARS:
        raise LiveError(f"content is over {MAX_APPEND_CHARS} characters", param="content")
    return text


def _system(text: str) -> dict[str, Any]:
    item = {"type": "message", "role": "system", "content": [{"type": "input_text", "text": text}]}
    return {"type": "conversation.item.create", "item": item}


def _output(call_id: str, text: str) -> dict[str, Any]:
    item = {"type": "function_call_output", "call_id": call_id, "output": text}
    return {"type": "conversation.item.create", "item": item}


class LiveProtocol:
    """One Live session's translation state: its delegations, the turns' spans on the input
    timeline, whether a response runs (a `response.create` waits for it), the mute."""

    def __init__(self, config: StartConfig, started_s: float | None = None) -> None:
        self.config = config
        self.started_s = time.monotonic() if started_s is None else started_s
        self.muted = False
        self.closing: str | None = None  # the reason, once a close is under way
        self.open_calls: dict[str, str] = {}  # delegation id -> the model's request
        self.responding = False  # a response is active in the session
        self.respond_later = False  # a response.create waits for the active one to end
        self._spans: dict[str, list[int]] = {}  # user item id -> [start_ms, end_ms]
        self._transcribed: set[str] = set()  # user items whose deltas went out
        self._said_from: dict[str, int] = {}  # assistant item id -> where its words began

    def usage(self) -> dict[str, Any]:
        return {"seconds": round(time.monotonic() - self.started_s, 3)}

    # ---- client events ----------------------------------------------------------------

    def client(self, ev: Any, out_ms: int) -> Step:
        """One Live client event (parsed JSON); `LiveError` for one refused."""
        if not isinstance(ev, dict) or not isinstance(ev.get("type"), str):
            raise LiveError("an event is a JSON object with a string type", param="type")
        kind, ack = ev["type"], {"client_event_id": ev.get("event_id")}
        if self.closing is not None and kind == "session.input_audio.append":
            return Step()  # what was on its way when the client closed
        if self.closing is not None and kind != "session.close":
            raise LiveError("the session is closing", code="session_closing", param="type")
        step = Step()
        if kind == "session.input_audio.append":
            pcm = self.config.format.decode(decode_b64(ev.get("audio"), "audio"))
            step.audio = np.zeros_like(pcm) if self.muted else pcm  # muted: the clock goes on
        elif kind in ("session.input_audio.mute", "session.input_audio.unmute"):
            self.muted = kind.endswith(".mute")
            step.send.append({"type": f"{kind}d", **ack})
        elif kind in (
            "session.instructions.append",
            "session.thinking.append",
            "session.commentary.append",
        ):
            self._append(kind, ev, step)
            step.send.append({"type": kind + "ed", **ack, "start_ms": out_ms, "end_ms": out_ms})
        elif kind == "response.item.create":
            step.handle.append(self._response_item(ev.get("item")))
        elif kind == "response.create":
            if self.open_calls:
                raise LiveError(
                    f"delegation(s) {', '.join(self.open_calls)} have no output yet: send a "
                    "function_call_output for each (response.item.create) first",
                    code="function_call_outputs_required",
                )
            self._respond(step)
        elif kind == "session.update":
            s = ev.get("session")
            if not isinstance(s, dict) or set(s) - {"delegation"}:
                raise _fail("only delegation changes once started", "session")
            _parse_delegation(s.get("delegation"))
            step.send.append({"type": "session.updated", **ack})  # the transport adds `session`
        elif kind == "session.close":
            self.closing = self.closing or "close_requested"
            step.close = self.closing
        elif kind == "session.start":
            raise LiveError("the session has started", code="session_already_started")
        else:
            raise LiveError(f"unknown event type {kind!r}", code="invalid_event", param="type")
        return step

    def _append(self, kind: str, ev: dict[str, Any], step: Step) -> None:
        text, delegation = _content(ev), ev.get("delegation_id")
        if delegation is not None and delegation not in self.open_calls:
            raise LiveError(
                f"no open delegation {delegation!r}", code="unknown_delegation",
                param="delegation_id",
            )  # fmt: skip
        if delegation is not None and kind != "session.instructions.append":
            del self.open_calls[delegation]
            step.handle.append(_output(delegation, text))
        elif kind == "session.instructions.append":
            step.handle.append(_system(f"From now on: {text}"))
        elif kind == "session.thinking.append":
            step.handle.append(_system(f"Context for you, not to be read out: {text}"))
        else:
            step.handle.append(_system(text))
        if kind == "session.commentary.append":
            self._respond(step)

    def _response_item(self, item: Any) -> dict[str, Any]:
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if call_id not in self.open_calls:
                raise LiveError(
                    f"no open delegation {call_id!r}", code="unknown_delegation",
                    param="item.call_id",
                )  # fmt: skip
            if not isinstance(output, str):
                output = json.dumps(output)
            del self.open_calls[call_id]
            return _output(call_id, output)
        if kind == "message" and isinstance(item, dict) and item.get("role") in ROLES:
            content = item.get("content")
            text = content if isinstance(content, str) else ""
            if isinstance(content, list):
                text = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            if not text:
                raise LiveError("item.content must hold text", param="item.content")
            role = ROLES[item["role"]]
            part = "output_text" if role == "assistant" else "input_text"
            msg = {"type": "message", "role": role, "content": [{"type": part, "text": text}]}
            return {"type": "conversation.item.create", "item": msg}
        raise LiveError(
            f"item.type = {kind!r}: function_call_output or a text message",
            param="item.type",
        )

    def _respond(self, step: Step) -> None:
        """Ask for an answer now, or once the active one ends (one response at a time)."""
        if self.responding:
            self.respond_later = True
        else:
            self.responding = True  # until response.done; the session's own turns alike
            step.handle.append({"type": "response.create"})

    def refused(self, event: dict[str, Any], e: ProtocolError) -> bool:
        """A Realtime event this protocol made was refused; True when that is no error for the
        client (a response started meanwhile: the request waits for it to end)."""
        if event.get("type") == "response.create":
            if e.code == "conversation_already_has_active_response":
                self.responding = self.respond_later = True
                return True
            self.responding = False
        return False

    # ---- session events ---------------------------------------------------------------

    def server(self, ev: dict[str, Any], out_ms: int) -> Step:
        """One session event (a Realtime server event) -> the Live events it makes, if any."""
        kind, step = ev.get("type"), Step()
        if kind == "input_audio_buffer.speech_started":
            self._spans[ev["item_id"]] = [ev["audio_start_ms"], ev["audio_start_ms"]]
        elif kind == "input_audio_buffer.speech_stopped":
            span = self._spans.setdefault(ev["item_id"], [ev["audio_end_ms"]] * 2)
            span[1] = ev["audio_end_ms"]
        elif kind == "conversation.item.input_audio_transcription.delta":
            self._transcribed.add(ev["item_id"])
            step.send.append(self._heard(ev["item_id"], ev.get("delta") or ""))
        elif kind == "conversation.item.input_audio_transcription.completed":
            item_id = ev["item_id"]
            if item_id not in self._transcribed and ev.get("transcript"):
                step.send.append(self._heard(item_id, ev["transcript"]))
            self._spans.pop(item_id, None)
            self._transcribed.discard(item_id)
        elif kind == "response.output_audio_transcript.delta" and ev.get("delta"):
            start = self._said_from.setdefault(ev["item_id"], out_ms)
            delta = {"type": "session.output_transcript.delta", "delta": ev["delta"]}
            step.send.append({**delta, "start_ms": start, "end_ms": max(start, out_ms)})
        elif kind == "response.output_item.done":
            item = ev.get("item") or {}
            self._said_from.pop(str(item.get("id")), None)
            if item.get("type") == "function_call" and item.get("name") == DELEGATE:
                step.send.append(self._delegate(item, out_ms))
        elif kind == "response.created":
            self.responding, self.respond_later = True, False
        elif kind == "response.done":
            self.responding = False
            step.send.append({"type": "session.usage.updated", "usage": self.usage()})
            if self.respond_later and self.closing is None:
                self.respond_later = False
                self._respond(step)
        elif kind == "error":
            err = ev.get("error") or {}
            code = err.get("code") or "server_error"
            e = LiveError(str(err.get("message", "")), code=code, param=err.get("param"))
            step.send.append(live_error(e))
        return step

    def _heard(self, item_id: str, text: str) -> dict[str, Any]:
        start, end = self._spans.get(item_id, [0, 0])
        return {"type": "session.input_transcript.delta", "delta": text, "start_ms": start,
                "end_ms": end}  # fmt: skip

    def _delegate(self, item: dict[str, Any], out_ms: int) -> dict[str, Any]:
        try:
            request = json.loads(item.get("arguments") or "{}").get("request", "")
        except (ValueError, AttributeError):
            request = ""
        call_id = str(item.get("call_id") or new_id("call"))
        self.open_calls[call_id] = str(request)
        delegation = {"id": call_id, "type": "delegation", "target": "client"}
        return {
            "type": "session.delegation.created",
            "offset_ms": out_ms,
            "delegation": {**delegation, "request": str(request)},
        }
