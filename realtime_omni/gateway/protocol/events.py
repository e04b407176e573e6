"""The OpenAI Realtime protocol's data: audio formats, conversation items from
`conversation.item.create`, error events and the beta names and shapes of server events. No I/O.
(Session settings and `session.update`: `settings.py`.)
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from realtime_omni.errors import OmniError
from realtime_omni.gateway.media import audio
from realtime_omni.gateway.media.audio import INPUT_RATE_HZ
from realtime_omni.gateway.protocol.conversation import Item, Part, new_id

MAX_EVENT_ID_CHARS = 512  # a client event's event_id: it comes back in the event's errors
MAX_JSON_DEPTH = 64  # a client's JSON nests no deeper; OpenAI's objects (a tool's schema) less
# A client's JSON holds no more values (arrays, objects, their members): parsing and walking
# 2.8 million of them (8 MiB of `[[],...]`) took seconds, 50,000 take milliseconds; a session
# with 128 tools of large schemas holds under 20,000.
MAX_JSON_NODES = 50_000
INLINE_JSON_BYTES = 32 << 10  # text up to this is parsed on the event loop, longer in a thread
_SCAN_PIECE = 1 << 18  # characters counted at a time, so a thread's scan lets the loop run
_SURROGATE = re.compile("[\ud800-\udfff]")


class ProtocolError(OmniError):
    """A client event the server refuses; becomes an `error` event, the connection lives on."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


def loads(raw: str | bytes, what: str = "") -> Any:
    """A client's JSON text as values; `ProtocolError` (`invalid_json`) for text that is not
    JSON, holds more than `MAX_JSON_NODES` values (counted before it is parsed), nests deeper
    than `MAX_JSON_DEPTH` (so nothing after recurses over it past Python's stack: merging,
    checking, dumping) or holds a lone surrogate (`"\\ud800"`: no UTF-8 text has one, and
    encoding it on the way out, to a client or a tokenizer, raises). It takes milliseconds a
    megabyte, and holds the GIL for them: from the event loop, use `loads_off_loop`."""
    where = f"{what}: " if what else ""
    if len(raw) > MAX_JSON_NODES and json_values_at_most(raw) > MAX_JSON_NODES:
        raise ProtocolError(
            f"{where}JSON with more than {MAX_JSON_NODES} values (arrays, objects and their "
            "members)",
            code="invalid_json",
        )
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"{where}not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise ProtocolError(f"{where}JSON nested too deeply", code="invalid_json") from None
    escaped = ("\\u" in raw) if isinstance(raw, str) else (b"\\u" in raw)  # else no surrogate
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth >= MAX_JSON_DEPTH:
                raise ProtocolError(
                    f"{where}JSON nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json"
                )
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
            if escaped and isinstance(v, dict):
                stack.extend((k, depth + 1) for k in v)
        elif escaped and isinstance(v, str) and _SURROGATE.search(v):
            raise ProtocolError(
                f"{where}a string holds a lone UTF-16 surrogate (\\ud800-\\udfff): not text",
                code="invalid_json",
            )
    return value


async def loads_off_loop(raw: str | bytes, what: str = "") -> Any:
    """`loads`, in a worker thread for text longer than `INLINE_JSON_BYTES`: a large message's
    count, parse and walk must not stall every other call's audio."""
    if len(raw) <= INLINE_JSON_BYTES:
        return loads(raw, what)
    return await asyncio.to_thread(loads, raw, what)


def json_values_at_most(raw: str | bytes) -> int:
    """At most how many values (arrays, objects, their members) JSON text holds, counted
    outside its strings without parsing: each array or object is one, and its members are one
    more than its commas. In pieces of `_SCAN_PIECE`, each a few C-speed passes, so a worker
    thread counting 8 MiB lets the event loop run between them."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    n, inside, i = 1, False, 0
    while i < len(text):
        j = min(i + _SCAN_PIECE, len(text))
        while j < len(text) and text[j - 1] == "\\":  # no escape is cut in two
            j += 1
        # Escaped backslashes and quotes out, the quotes left bound the strings.
        parts = text[i:j].replace("\\\\", "").replace('\\"', "").split('"')
        outside = "".join(parts[1::2] if inside else parts[0::2])
        n += 2 * (outside.count("[") + outside.count("{")) + outside.count(",")
        inside ^= len(parts) % 2 == 0  # an odd number of quotes: a string goes on
        i = j
    return n


@dataclass(frozen=True)
class AudioFormat:
    name: str  # "pcm16" | "g711_ulaw" | "g711_alaw"
    rate_hz: int

    @property
    def sample_bytes(self) -> int:
        return 2 if self.name == "pcm16" else 1

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

# OpenAI's limits on a `metadata` object (the same for responses as for its other objects).
METADATA_MAX_KEYS = 16
METADATA_MAX_KEY_CHARS = 64
METADATA_MAX_VALUE_CHARS = 512


def parse_metadata(value: Any, param: str) -> dict[str, str] | None:
    """`response.create`'s `metadata`: up to 16 string pairs (keys of at most 64 characters,
    values of 512) that the response carries back unchanged in its `response.created` and
    `response.done`; clients match a response to their request by them (LiveKit's plugin sends
    `{"client_event_id": ...}` and waits for it)."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > METADATA_MAX_KEYS:
        raise ProtocolError(
            f"{param} must be an object of at most {METADATA_MAX_KEYS} string pairs", param=param
        )
    for k, v in value.items():
        if len(k) > METADATA_MAX_KEY_CHARS or not isinstance(v, str):
            raise ProtocolError(
                f"{param}[{k[:METADATA_MAX_KEY_CHARS]!r}]: keys are strings of at most "
                f"{METADATA_MAX_KEY_CHARS} characters, values strings",
                param=param,
            )
        if len(v) > METADATA_MAX_VALUE_CHARS:
            raise ProtocolError(
                f"{param}[{k!r}] is longer than {METADATA_MAX_VALUE_CHARS} characters",
                param=param,
            )
    return dict(value)


def event_id() -> str:
    return f"event_{uuid.uuid4().hex[:20]}"


def checked_event_id(event: Any) -> str | None:
    """A client event's `event_id`, None without one; `ProtocolError` naming `event_id` for one
    that is not a string of at most `MAX_EVENT_ID_CHARS`. Its errors echo it, and a resumable
    session keeps its errors: a message-sized id would make each of them that large."""
    value = event.get("event_id") if isinstance(event, dict) else None
    if value is None or (isinstance(value, str) and len(value) <= MAX_EVENT_ID_CHARS):
        return value
    if not isinstance(value, str):
        raise ProtocolError("event_id must be a string", code="invalid_type", param="event_id")
    raise ProtocolError(
        f"event_id is {len(value)} characters long; it may be at most {MAX_EVENT_ID_CHARS}",
        code="string_above_max_length",
        param="event_id",
    )


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
# Decoded whole before the scaling (but a JPEG, decoded at a reduced size): 40 MP is 120 MB of
# RGB for a moment. Formats by their header; others are refused before any decoding.
MAX_IMAGE_PIXELS = 40_000_000
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")


def parse_item(spec: Any, input_format: AudioFormat) -> Item:
    """The `item` of a `conversation.item.create`: a message of text, audio (in the session's
    input format, resampled to the VAD's 16 kHz) and images (data: URLs)."""
    if isinstance(spec, dict) and spec.get("type") in ("function_call", "function_call_output"):
        return _parse_call_item(spec)
    if not isinstance(spec, dict) or spec.get("type", "message") != "message":
        raise ProtocolError(
            "item must be an object of type message, function_call or function_call_output",
            param="item",
        )
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


def _parse_call_item(spec: dict[str, Any]) -> Item:
    """A function call (the model's, as a client replays it) or its output (the client's
    answer to one)."""
    kind = spec["type"]
    fields = ("call_id", "name", "arguments") if kind == "function_call" else ("call_id", "output")
    values: dict[str, Any] = {}
    for key in fields:
        v = spec.get(key, "")
        if not isinstance(v, str) or (key in ("call_id", "name") and not v):
            raise ProtocolError(f"item.{key} must be a non-empty string", param=f"item.{key}")
        values[key] = v
    role = "assistant" if kind == "function_call" else "tool"
    return Item(spec.get("id") or new_id("item"), role, type=kind, **values)


def _parse_part(c: Any, param: str, input_format: AudioFormat) -> Part:
    kind = c.get("type") if isinstance(c, dict) else None
    if kind in ("input_text", "text", "output_text"):
        if not isinstance(c.get("text"), str):
            raise ProtocolError(f"{param}.text must be a string", param=param)
        return Part("text", text=c["text"])
    if kind == "input_audio":
        pcm = input_format.decode(decode_b64(c.get("audio"), f"{param}.audio"))
        r = audio.Resampler(input_format.rate_hz, INPUT_RATE_HZ)
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
        img: Image.Image = Image.open(io.BytesIO(raw), formats=IMAGE_FORMATS)  # the header alone
    except (UnidentifiedImageError, OSError, ValueError):
        raise ProtocolError(
            f"{param}: not an image of the formats taken ({', '.join(IMAGE_FORMATS)})",
            param=param,
        ) from None
    # Checked before decoding: a 13,000 x 13,000 PNG of 219 KB decoded to 809 MB.
    if img.width * img.height > MAX_IMAGE_PIXELS:
        raise ProtocolError(
            f"{param}: {img.width} x {img.height} pixels is over the limit of "
            f"{MAX_IMAGE_PIXELS:,}; scale it down (it is seen at {MAX_IMAGE_SIDE} px at most)",
            code="image_too_large",
            param=param,
        )
    try:
        img.draft("RGB", (MAX_IMAGE_SIDE, MAX_IMAGE_SIDE))  # JPEG: decode at a reduced size
        img = img.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError):
        raise ProtocolError(f"{param}: the image cannot be decoded", param=param) from None
    img.thumbnail((MAX_IMAGE_SIDE, MAX_IMAGE_SIDE))
    return np.asarray(img, np.uint8).copy()


def audio_too_fast(seconds: float, speed: float, burst_s: float) -> ProtocolError:
    """What a client is told whose append of `seconds` of audio the session's audio credit
    (`media.input_buffer.AudioCredit`: `burst_s`, then `speed` x real time) refused."""
    return ProtocolError(
        f"audio is coming faster than {speed:g}x real time (after a first {burst_s:g} s): "
        f"this append of {seconds:.1f} s was dropped; send audio about as fast as it is spoken",
        code="rate_limit_exceeded",
        param="audio",
    )
