"""The OpenAI Realtime protocol's data: session settings (GA nested and beta flat shapes), audio
formats, conversation items from `conversation.item.create`, error events and the beta names
of server events. No I/O.
"""

from __future__ import annotations

import base64
import binascii
import io
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from realtime_omni.gateway import audio
from realtime_omni.gateway.conversation import Item, Part, new_id
from realtime_omni.gateway.turns import TurnParams
from realtime_omni.gateway.vad import SAMPLE_RATE_HZ as VAD_RATE_HZ
from realtime_omni.gateway.vad import VadParams


class ProtocolError(Exception):
    """A client event the server refuses; becomes an `error` event, the connection lives on."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


@dataclass(frozen=True)
class AudioFormat:
    name: str  # "pcm16" | "g711_ulaw" | "g711_alaw"
    rate_hz: int

    def decode(self, data: bytes) -> np.ndarray:
        if self.name == "pcm16":
            if len(data) % 2:
                raise ProtocolError("pcm16 audio has an odd number of bytes", param="audio")
            return audio.pcm16_to_float(data)
        return audio.ulaw_decode(data) if self.name == "g711_ulaw" else audio.alaw_decode(data)

    def encode(self, x: np.ndarray) -> bytes:
        if self.name == "pcm16":
            return audio.float_to_pcm16(x)
        return audio.ulaw_encode(x) if self.name == "g711_ulaw" else audio.alaw_encode(x)

    def ga(self) -> dict[str, Any]:
        kind = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}
        return {"type": kind[self.name], "rate": self.rate_hz}


PCM16 = AudioFormat("pcm16", 24000)
_BY_NAME = {
    "pcm16": PCM16,
    "g711_ulaw": AudioFormat("g711_ulaw", 8000),
    "g711_alaw": AudioFormat("g711_alaw", 8000),
}
_BY_TYPE = {"audio/pcm": "pcm16", "audio/pcmu": "g711_ulaw", "audio/pcma": "g711_alaw"}


def parse_format(value: Any, param: str) -> AudioFormat:
    """`"pcm16"` (beta) or `{"type": "audio/pcm", "rate": 24000}` (GA)."""
    if isinstance(value, str) and value in _BY_NAME:
        return _BY_NAME[value]
    if isinstance(value, dict) and value.get("type") in _BY_TYPE:
        fmt = _BY_NAME[_BY_TYPE[value["type"]]]
        if value.get("rate", fmt.rate_hz) != fmt.rate_hz:
            raise ProtocolError(
                f"{param}.rate must be {fmt.rate_hz} for {value['type']}", param=param
            )
        return fmt
    raise ProtocolError(
        f"{param} = {value!r}: use pcm16, g711_ulaw, g711_alaw or "
        '{"type": "audio/pcm" | "audio/pcmu" | "audio/pcma"}',
        param=param,
    )


@dataclass(frozen=True)
class TurnDetection:
    """OpenAI's `server_vad`, plus how speech over the bot is judged (`gateway/turns.py`):
    `min_interruption_ms` of it is an interruption (0: any speech start is), and speech over
    the bot that falls silent for `resume_after_ms` first lets the answer resume."""

    vad: VadParams = field(default_factory=VadParams)
    create_response: bool = True
    interrupt_response: bool = True
    turns: TurnParams = field(default_factory=TurnParams)

    def to_openai(self) -> dict[str, Any]:
        return {
            "type": "server_vad",
            "threshold": self.vad.threshold,
            "prefix_padding_ms": self.vad.prefix_padding_ms,
            "silence_duration_ms": self.vad.silence_duration_ms,
            "create_response": self.create_response,
            "interrupt_response": self.interrupt_response,
            "min_interruption_ms": self.turns.min_interruption_ms,
            "resume_after_ms": self.turns.resume_after_ms,
            "echo_gate": self.turns.echo_gate,
        }


@dataclass(frozen=True)
class Settings:
    """What `session.update` can change."""

    model: str = "qwen3-omni"
    instructions: str = ""
    voice: str | None = None
    temperature: float | None = None
    max_output_tokens: int | None = None
    input_format: AudioFormat = PCM16
    output_format: AudioFormat = PCM16
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    # WebRTC's echo canceller on the microphone's audio (gateway/echo.py; needs `livekit`): an
    # extension field, `audio.input.echo_cancellation` (beta: `input_audio_echo_cancellation`).
    # Off by default: with no echo path (a phone, a headset, a browser cancelling echo itself)
    # it still damps the person talking over the bot by 5-18 dB for seconds, which turn-taking
    # cannot afford; the echo gate (turn_detection.echo_gate) keeps the bot's echo from
    # interrupting it without touching the audio.
    echo_cancellation: bool = False
    # "auto", "disabled", or a retention ratio in (0, 1]: what happens when the conversation's
    # audio and images outgrow one turn's payload (`Conversation.fit`).
    truncation: str | float = "auto"

    def truncation_openai(self) -> Any:
        if isinstance(self.truncation, str):
            return self.truncation
        return {"type": "retention_ratio", "retention_ratio": self.truncation}

    def to_openai(self, session_id: str, beta: bool = False) -> dict[str, Any]:
        td = self.turn_detection.to_openai() if self.turn_detection else None
        max_tokens: Any = self.max_output_tokens if self.max_output_tokens is not None else "inf"
        if beta:
            return {  # no `model`: beta's type allows only OpenAI's names, or none
                "id": session_id,
                "object": "realtime.session",
                "modalities": ["audio", "text"],
                "instructions": self.instructions,
                "voice": self.voice,
                "input_audio_format": self.input_format.name,
                "input_audio_echo_cancellation": self.echo_cancellation,
                "output_audio_format": self.output_format.name,
                "turn_detection": td,
                "temperature": self.temperature,
                "max_response_output_tokens": max_tokens,
            }
        return {
            "type": "realtime",
            "id": session_id,
            "object": "realtime.session",
            "model": self.model,
            "output_modalities": ["audio"],
            "instructions": self.instructions,
            "audio": {
                "input": {
                    "format": self.input_format.ga(),
                    "turn_detection": td,
                    "echo_cancellation": self.echo_cancellation,
                },
                "output": {"format": self.output_format.ga(), "voice": self.voice},
            },
            "max_output_tokens": max_tokens,
            "truncation": self.truncation_openai(),
        }


def parse_truncation(v: Any) -> str | float:
    """GA `truncation`: "auto", "disabled" or `{type: retention_ratio, retention_ratio}`."""
    if v in ("auto", "disabled"):
        return str(v)
    if isinstance(v, dict) and v.get("type") == "retention_ratio":
        return _number(v.get("retention_ratio"), "truncation.retention_ratio", 0.01, 1.0)
    raise ProtocolError(
        f"truncation = {v!r}: use 'auto', 'disabled' or "
        "{'type': 'retention_ratio', 'retention_ratio': 0.8}",
        param="session.truncation",
    )


def _number(v: Any, param: str, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        raise ProtocolError(f"{param} = {v!r}: must be a number in [{lo}, {hi}]", param=param)
    return float(v)


def _flag(obj: dict[str, Any], key: str, where: str = "") -> bool:
    if not isinstance(obj[key], bool):
        raise ProtocolError(f"{where}{key} must be true or false", param=f"{where}{key}")
    return bool(obj[key])


def parse_turn_detection(v: Any, current: TurnDetection | None) -> TurnDetection | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ProtocolError("turn_detection must be an object or null", param="turn_detection")
    kind = v.get("type", "server_vad")
    if kind != "server_vad":
        raise ProtocolError(
            f"turn_detection.type = {kind!r}: only server_vad (or null) is supported",
            code="unsupported_value",
            param="turn_detection.type",
        )
    td = current or TurnDetection()
    vad = td.vad
    if "threshold" in v:
        vad = replace(vad, threshold=_number(v["threshold"], "turn_detection.threshold", 0, 1))
    for key in ("prefix_padding_ms", "silence_duration_ms"):
        if key in v:
            vad = replace(vad, **{key: int(_number(v[key], f"turn_detection.{key}", 0, 10000))})
    turns = td.turns
    for key in ("min_interruption_ms", "resume_after_ms"):
        if key in v:
            turns = replace(turns, **{key: int(_number(v[key], f"turn_detection.{key}", 0, 10000))})
    if "echo_gate" in v:
        turns = replace(turns, echo_gate=_flag(v, "echo_gate", "turn_detection."))
    return TurnDetection(
        vad,
        bool(v.get("create_response", td.create_response)),
        bool(v.get("interrupt_response", td.interrupt_response)),
        turns,
    )


def apply_session_update(s: Settings, session: Any) -> Settings:
    """`session.update`'s `session` object (GA nested or beta flat) applied to `s`."""
    if not isinstance(session, dict):
        raise ProtocolError("session must be an object", param="session")
    changes: dict[str, Any] = {}
    if "instructions" in session:
        if not isinstance(session["instructions"], str):
            raise ProtocolError("instructions must be a string", param="session.instructions")
        changes["instructions"] = session["instructions"]
    if "temperature" in session:
        changes["temperature"] = _number(session["temperature"], "session.temperature", 0, 2)
    for key in ("max_output_tokens", "max_response_output_tokens"):
        if key in session:
            v = session[key]
            changes["max_output_tokens"] = (
                None if v == "inf" else int(_number(v, f"session.{key}", 1, 1 << 20))
            )
    if "voice" in session:
        changes["voice"] = session["voice"]
    if "input_audio_format" in session:
        changes["input_format"] = parse_format(session["input_audio_format"], "input_audio_format")
    if "output_audio_format" in session:
        changes["output_format"] = parse_format(
            session["output_audio_format"], "output_audio_format"
        )
    if "truncation" in session:
        changes["truncation"] = parse_truncation(session["truncation"])
    td = s.turn_detection
    if "input_audio_echo_cancellation" in session:
        changes["echo_cancellation"] = _flag(session, "input_audio_echo_cancellation")
    if "turn_detection" in session:
        changes["turn_detection"] = parse_turn_detection(session["turn_detection"], td)
    a = session.get("audio")
    if a is not None:
        if not isinstance(a, dict):
            raise ProtocolError("session.audio must be an object", param="session.audio")
        inp, out = a.get("input") or {}, a.get("output") or {}
        if "format" in inp:
            changes["input_format"] = parse_format(inp["format"], "audio.input.format")
        if "turn_detection" in inp:
            changes["turn_detection"] = parse_turn_detection(inp["turn_detection"], td)
        if "echo_cancellation" in inp:
            changes["echo_cancellation"] = _flag(inp, "echo_cancellation", "audio.input.")
        if "format" in out:
            changes["output_format"] = parse_format(out["format"], "audio.output.format")
        if "voice" in out:
            changes["voice"] = out["voice"]
    if (
        "voice" in changes
        and changes["voice"] is not None
        and not isinstance(changes["voice"], str)
    ):
        raise ProtocolError("voice must be a string", param="voice")
    return replace(s, **changes)


def decode_b64(data: Any, param: str) -> bytes:
    if not isinstance(data, str):
        raise ProtocolError(f"{param} must be a base64 string", param=param)
    try:
        if len(data) <= _B64_PIECE:
            return base64.b64decode(data, validate=True)
        # In pieces (whole 4-character groups): from a worker thread, each piece holds the GIL
        # for a millisecond or two instead of the whole decode (14 ms for 8 MB).
        pieces = range(0, len(data), _B64_PIECE)
        return b"".join(base64.b64decode(data[i : i + _B64_PIECE], validate=True) for i in pieces)
    except (binascii.Error, ValueError):
        raise ProtocolError(f"{param} is not valid base64", param=param) from None


_B64_PIECE = 1 << 19  # characters, a multiple of 4


def event_id() -> str:
    return f"event_{uuid.uuid4().hex[:20]}"


def error_event(
    message: str,
    code: str = "invalid_value",
    param: str | None = None,
    client_event_id: str | None = None,
    kind: str = "invalid_request_error",
) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {
            "type": kind,
            "code": code,
            "message": message,
            "param": param,
            "event_id": client_event_id,
        },
    }


# GA server event names -> beta (OpenAI-Beta: realtime=v1) names; the rest are shared.
BETA_NAMES = {
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_text.delta": "response.text.delta",
    "response.output_text.done": "response.text.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
    "conversation.item.added": "conversation.item.created",
}
GA_ONLY = {"conversation.item.done"}  # beta clients never heard of it


def for_beta(event: dict[str, Any]) -> dict[str, Any] | None:
    """A GA server event as a beta client expects it (None: not sent to beta clients)."""
    kind = event["type"]
    if kind in GA_ONLY:
        return None
    if kind in BETA_NAMES:
        event = dict(event, type=BETA_NAMES[kind])
    if isinstance(event.get("item"), dict):
        event = dict(event, item=_beta_item(event["item"]))
    resp = event.get("response")
    if isinstance(resp, dict) and isinstance(resp.get("output"), list):
        event = dict(event, response=dict(resp, output=[_beta_item(i) for i in resp["output"]]))
    return event


_BETA_CONTENT = {"output_audio": "audio", "output_text": "text"}


def _beta_item(item: dict[str, Any]) -> dict[str, Any]:
    """An item's content in beta's types: `audio`/`text` for the assistant's; images, which
    beta has no type for, left out."""
    content = item.get("content")
    if not isinstance(content, list):
        return item
    out = [
        dict(c, type=_BETA_CONTENT.get(c.get("type"), c.get("type")))
        for c in content
        if c.get("type") != "input_image"
    ]
    return dict(item, content=out)


MAX_IMAGE_SIDE = 1280  # larger images are scaled down before they join the conversation


def parse_item(spec: Any, input_format: AudioFormat) -> Item:
    """The `item` of a `conversation.item.create`: a message of text, audio (in the session's
    input format, resampled to the VAD's 16 kHz) and images (data: URLs)."""
    if not isinstance(spec, dict) or spec.get("type", "message") != "message":
        raise ProtocolError("item must be an object of type message", param="item")
    role = spec.get("role")
    if role not in ("user", "assistant", "system"):
        raise ProtocolError(f"item.role = {role!r}: user, assistant or system", param="item.role")
    content = spec.get("content")
    if not isinstance(content, list) or not content:
        raise ProtocolError("item.content must be a non-empty list", param="item.content")
    item = Item(spec.get("id") or new_id("item"), role)
    for i, c in enumerate(content):
        part = _parse_part(c, f"item.content[{i}]", input_format)
        if role == "assistant" and part.kind == "text":
            item.add_text(0.0, part.text)
        else:
            item.parts.append(part)
    return item


def _parse_part(c: Any, param: str, input_format: AudioFormat) -> Part:
    kind = c.get("type") if isinstance(c, dict) else None
    if kind in ("input_text", "text", "output_text"):
        if not isinstance(c.get("text"), str):
            raise ProtocolError(f"{param}.text must be a string", param=param)
        return Part("text", text=c["text"])
    if kind == "input_audio":
        pcm = input_format.decode(decode_b64(c.get("audio"), f"{param}.audio"))
        r = audio.Resampler(input_format.rate_hz, VAD_RATE_HZ)
        return Part("audio", audio=np.concatenate([r.process(pcm), r.flush()]))
    if kind == "input_image":
        return Part("image", image=_decode_image(c.get("image_url"), f"{param}.image_url"))
    raise ProtocolError(
        f"{param}.type = {kind!r}: use input_text, input_audio or input_image", param=param
    )


def _decode_image(url: Any, param: str) -> np.ndarray:
    if not isinstance(url, str) or not url.startswith("data:") or "," not in url:
        raise ProtocolError(f"{param} must be a data: URL (base64 PNG or JPEG)", param=param)
    from PIL import Image, UnidentifiedImageError

    raw = decode_b64(url.split(",", 1)[1], param)
    try:
        img = Image.open(io.BytesIO(raw))
        img.draft("RGB", (MAX_IMAGE_SIDE, MAX_IMAGE_SIDE))  # JPEG: decode at a reduced size
        img = img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise ProtocolError(f"{param}: not an image ({e})", param=param) from None
    img.thumbnail((MAX_IMAGE_SIDE, MAX_IMAGE_SIDE))
    return np.asarray(img, np.uint8).copy()
