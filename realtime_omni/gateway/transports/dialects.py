"""The three phone providers' media-stream messages, parsed and built: Twilio, Telnyx and Plivo
spell the same few messages differently (a `start` naming the stream, `media` both ways, a mark
echoed once the audio before it was played, a clear). No I/O: a `Dialect` turns one provider's
parsed JSON into an `Inbound` (or raises `BadMessage`) and builds what is sent back.

    dialect = DIALECTS["twilio"]
    ev = dialect.parse(json_message)   # Inbound: start, media, mark, dtmf, connected or stop
    dialect.media(stream_id, b64), dialect.mark(stream_id, name), dialect.clear(stream_id)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from realtime_omni.errors import OmniError
from realtime_omni.gateway.transports.phone import RATE_HZ


class BadMessage(OmniError):
    """A message that does not follow the provider's protocol."""


@dataclass(frozen=True)
class Start:
    stream_id: str
    call_id: str
    codec: str  # "ulaw" | "alaw"
    parameters: dict[str, str]


@dataclass(frozen=True)
class Inbound:
    kind: str  # connected start media dtmf mark stop cleared
    start: Start | None = None
    payload: str = ""  # media: base64; dtmf: the digit; mark: its name


def _obj(msg: dict[str, Any], key: str) -> dict[str, Any]:
    v = msg.get(key)
    if not isinstance(v, dict):
        raise BadMessage(f"`{key}` must be an object")
    return v


def _str(obj: dict[str, Any], key: str) -> str:
    v = obj.get(key)
    if not isinstance(v, str) or not v:
        raise BadMessage(f"`{key}` must be a non-empty string")
    return v


def _codec(encoding: Any) -> str:
    enc = str(encoding).lower()
    if enc in ("audio/x-mulaw", "pcmu", "mulaw", "ulaw"):
        return "ulaw"
    if enc in ("audio/x-alaw", "pcma", "alaw"):
        return "alaw"
    raise BadMessage(f"media format {encoding!r}: only G.711 mu-law or A-law at 8 kHz is spoken")


def _rate(rate: Any) -> None:
    if rate not in (None, RATE_HZ, str(RATE_HZ)):
        raise BadMessage(f"sample rate {rate!r}: only {RATE_HZ} Hz is spoken")


def _params(v: Any) -> dict[str, str]:
    return {str(k): str(x) for k, x in v.items()} if isinstance(v, dict) else {}


@dataclass(frozen=True)
class Dialect:
    name: str
    parse: Callable[[dict[str, Any]], Inbound]
    media: Callable[[str, str], dict[str, Any]]  # (stream_id, base64) -> message
    mark: Callable[[str, str], dict[str, Any]]  # (stream_id, name) -> message
    clear: Callable[[str], dict[str, Any]]  # stream_id -> message


def _twilio(msg: dict[str, Any]) -> Inbound:
    kind = msg.get("event")
    if kind == "start":
        s = _obj(msg, "start")
        fmt = s.get("mediaFormat") or {}
        _rate(fmt.get("sampleRate"))
        start = Start(
            _str(s, "streamSid"),
            _str(s, "callSid"),
            _codec(fmt.get("encoding", "audio/x-mulaw")),
            _params(s.get("customParameters")),
        )
        return Inbound("start", start)
    return _common(msg, kind)


def _telnyx(msg: dict[str, Any]) -> Inbound:
    kind = msg.get("event")
    if kind == "start":
        s = _obj(msg, "start")
        fmt = s.get("media_format") or {}
        _rate(fmt.get("sample_rate"))
        params = _params(s.get("custom_parameters"))
        if isinstance(s.get("client_state"), str):
            params.setdefault("client_state", s["client_state"])
        stream = msg.get("stream_id") or s.get("stream_id")
        start = Start(
            _str({"stream_id": stream}, "stream_id"),
            _str(s, "call_control_id"),
            _codec(fmt.get("encoding", "PCMU")),
            params,
        )
        return Inbound("start", start)
    if kind == "media" and _obj(msg, "media").get("track", "inbound") != "inbound":
        return Inbound("ignored")  # both_tracks: the bot's own audio comes back too
    return _common(msg, kind)


def _plivo(msg: dict[str, Any]) -> Inbound:
    kind = msg.get("event")
    if kind == "start":
        s = _obj(msg, "start")
        fmt = s.get("mediaFormat") or {}
        _rate(fmt.get("sampleRate"))
        params = _params(s.get("customParameters"))
        # Plivo passes a stream's extra headers as "k1=v1,k2=v2"
        for pair in str(s.get("extra_headers") or "").split(","):
            k, eq, v = pair.partition("=")
            if eq and k.strip():
                params.setdefault(k.strip(), v.strip())
        start = Start(
            _str(s, "streamId"),
            _str(s, "callId"),
            _codec(fmt.get("encoding", "audio/x-mulaw")),
            params,
        )
        return Inbound("start", start)
    if kind == "playedStream":
        return Inbound("mark", payload=_str(msg, "name"))
    if kind == "clearedAudio":
        return Inbound("cleared")
    return _common(msg, kind)


def _common(msg: dict[str, Any], kind: Any) -> Inbound:
    if kind == "media":
        return Inbound("media", payload=_str(_obj(msg, "media"), "payload"))
    if kind == "dtmf":
        return Inbound("dtmf", payload=_str(_obj(msg, "dtmf"), "digit"))
    if kind == "mark":
        return Inbound("mark", payload=_str(_obj(msg, "mark"), "name"))
    if kind in ("connected", "stop"):
        return Inbound(kind)
    raise BadMessage(f"unknown event {kind!r}")


DIALECTS = {
    "twilio": Dialect(
        "twilio",
        _twilio,
        media=lambda sid, b64: {"event": "media", "streamSid": sid, "media": {"payload": b64}},
        mark=lambda sid, n: {"event": "mark", "streamSid": sid, "mark": {"name": n}},
        clear=lambda sid: {"event": "clear", "streamSid": sid},
    ),
    "telnyx": Dialect(
        "telnyx",
        _telnyx,
        media=lambda sid, b64: {"event": "media", "media": {"payload": b64}},
        mark=lambda sid, n: {"event": "mark", "mark": {"name": n}},
        clear=lambda sid: {"event": "clear"},
    ),
    "plivo": Dialect(
        "plivo",
        _plivo,
        media=lambda sid, b64: {
            "event": "playAudio",
            "streamId": sid,
            "media": {"contentType": "audio/x-mulaw", "sampleRate": RATE_HZ, "payload": b64},
        },
        mark=lambda sid, n: {"event": "checkpoint", "streamId": sid, "name": n},
        clear=lambda sid: {"event": "clearAudio", "streamId": sid},
    ),
}
