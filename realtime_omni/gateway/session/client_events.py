"""What each OpenAI Realtime client event does, decided without I/O.

    effects = client.decide(event, view, now)   # ProtocolError: refused, and nothing was done

`ClientEvents.decide` takes one parsed client event, what the session is now (`View`: its
settings, conversation, input buffer and active response, read only) and the time, and returns
what to do, in order: the effects below, which the session's driver (`driver.Session`) carries
out. Every refusal is decided here, before any effect: an event is done whole or not at all.
Its one state of its own is the rate at which `input_audio_buffer.append` may send audio.

Two effects leave work to the driver that is not a decision: `PushAudio` carries the base64 text
(a driver decodes a large one off the event loop) and `AddItem` the raw item (parsed off the
event loop: base64 audio, images).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from realtime_omni.gateway.media.audio import INPUT_RATE_HZ
from realtime_omni.gateway.media.input_buffer import AudioCredit, InputBuffer, b64_seconds
from realtime_omni.gateway.protocol.conversation import ROOT, Conversation, Item, new_id
from realtime_omni.gateway.protocol.events import (
    ProtocolError,
    audio_too_fast,
    checked_event_id,
    error_event,
    loads,
    parse_metadata,
)
from realtime_omni.gateway.protocol.session_update import apply_session_update
from realtime_omni.gateway.protocol.settings import Settings, Voices
from realtime_omni.gateway.session.response import Response

# What `response.create`'s `response` may set for that response alone.
RESPONSE_FIELDS = (
    "instructions",
    "voice",
    "temperature",
    "max_output_tokens",
    "output_modalities",
    "tools",
    "tool_choice",
)
# What a transcription session refuses: it never answers, so nothing makes, cuts or plays one.
ANSWER_EVENTS = frozenset(
    {
        "response.create",
        "response.cancel",
        "conversation.item.create",
        "conversation.item.truncate",
        "output_audio_buffer.clear",
    }
)
TRUNCATE_SLACK_MS = 40  # a truncate this far past an item's audio keeps all of it
MIN_COMMIT_MS = 100  # OpenAI refuses to commit less


class View(Protocol):
    """What the decisions read of a session (`driver.Session` is one)."""

    id: str
    voices: Voices
    conversation: Conversation
    input: InputBuffer
    aec_available: bool  # WebRTC's echo canceller can be loaded here

    @property
    def settings(self) -> Settings: ...
    @property
    def responding(self) -> Response | None:
        """The active response."""
        ...

    @property
    def last_response_id(self) -> str | None: ...
    @property
    def turn_item_id(self) -> str | None:
        """The item id the speech now being heard will get, if any is being heard."""
        ...


# ---- effects: what the driver does, in order ----------------------------------------------


@dataclass(frozen=True)
class Emit:
    """Send a server event."""

    type: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SetSettings:
    """The session is now `settings` (turn detection, echo cancellation and the input follow)."""

    settings: Settings


@dataclass(frozen=True)
class PushAudio:
    """Decode `audio` (base64 in `settings.input_format`) and push it as microphone audio."""

    audio: str
    settings: Settings


@dataclass(frozen=True)
class ClearInput:
    """Empty the input buffer and start turn detection afresh."""


@dataclass(frozen=True)
class CommitAudio:
    """`pcm` (16 kHz) becomes the user item `item_id`, announced and transcribed."""

    pcm: np.ndarray
    item_id: str


@dataclass(frozen=True)
class Flush:
    """Drop the queued audio of `item_id` (None: all of it) here and downstream."""

    item_id: str | None = None


@dataclass(frozen=True)
class AddItem:
    """Parse `item` (off the event loop) and insert it after `previous_item_id`; announce it."""

    item: Any
    previous_item_id: str | None
    settings: Settings


@dataclass(frozen=True)
class CancelResponse:
    """Stop the active response (its request aborted in every stage, awaited). With
    `speech_goes_on`, speech being judged over it goes on as the next turn."""

    reason: str
    speech_goes_on: bool = False


@dataclass(frozen=True)
class TruncateItem:
    """Cut the assistant item to `audio_end_ms` (a client's playback position: within
    `TRUNCATE_SLACK_MS` past the audio it keeps all of it) and announce it."""

    item_id: str
    audio_end_ms: int


@dataclass(frozen=True)
class DeleteItem:
    item_id: str


@dataclass(frozen=True)
class StartResponse:
    """Start a response with these settings of its own over the session's."""

    overrides: dict[str, Any]


Effect = (
    Emit
    | SetSettings
    | PushAudio
    | ClearInput
    | CommitAudio
    | Flush
    | AddItem
    | CancelResponse
    | TruncateItem
    | DeleteItem
    | StartResponse
)


class ClientEvents:
    """The client events' decisions; `credit` is what `input_audio_buffer.append` may still
    send (audio about as fast as it is spoken, after a first burst)."""

    def __init__(self, credit: AudioCredit | None = None) -> None:
        self.credit = credit or AudioCredit()

    def decide(self, event: Any, view: View, now: float) -> list[Effect]:
        """What one client event does. Raises `ProtocolError` for one refused."""
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            raise ProtocolError("an event must be a JSON object with a string `type`", param="type")
        kind = event["type"]
        decide = _DECISIONS.get(kind)
        if decide is None:
            raise ProtocolError(f"unknown event type {kind!r}", code="invalid_event", param="type")
        if kind in ANSWER_EVENTS and view.settings.type == "transcription":
            raise ProtocolError(  # OpenAI's word for an event type a session does not take
                f"Invalid value: {kind!r}: a transcription session transcribes the caller and "
                "never answers; it takes session.update, input_audio_buffer.append, .commit "
                "and .clear, conversation.item.retrieve and .delete",
                code="invalid_value",
                param="type",
            )
        return decide(self, event, view, now)

    def _session_update(self, ev: dict[str, Any], v: View, now: float) -> list[Effect]:
        """What parses is applied; each field refused is one `error` naming it, before the
        `session.updated` that shows what the session now is."""
        s, refused = apply_session_update(v.settings, ev.get("session"), v.voices, v.aec_available)
        errors: list[Effect] = [
            Emit("error", {"error": error(e, ev.get("event_id"))["error"]}) for e in refused
        ]
        return [SetSettings(s), *errors, Emit("session.updated", {"session": s.to_openai(v.id)})]

    def _append(self, ev: dict[str, Any], v: View, now: float) -> list[Effect]:
        audio = ev.get("audio")
        if not isinstance(audio, str):
            raise ProtocolError("audio must be a base64 string", param="audio")
        fmt = v.settings.input_format
        seconds = b64_seconds(len(audio), fmt.sample_bytes, fmt.rate_hz)
        if not self.credit.take(seconds, now):
            raise audio_too_fast(seconds, self.credit.speed, self.credit.burst_s)
        return [PushAudio(audio, v.settings)]

    def _commit(self, ev: dict[str, Any], v: View, now: float) -> list[Effect]:
        pcm = v.input.slice(v.input.start, v.input.end)
        if len(pcm) * 1000 < MIN_COMMIT_MS * INPUT_RATE_HZ:
            raise ProtocolError(
                f"buffer too small: expected at least {MIN_COMMIT_MS} ms of audio, "
                f"got {len(pcm) * 1000 / INPUT_RATE_HZ:.0f} ms",
                code="input_audio_buffer_commit_empty",
            )
        return [ClearInput(), CommitAudio(pcm, v.turn_item_id or new_id("item"))]

    def _clear(self, ev: dict[str, Any], v: View, now: float) -> list[Effect]:
        return [ClearInput(), Emit("input_audio_buffer.cleared")]

    def _output_clear(self, ev: dict[str, Any], v: View, now: float) -> list[Effect]:
        active = v.responding
        rid = active.id if active is not None else v.last_response_id
        if rid is None:  # nothing was ever played: no buffer to have cleared
            return [Flush()]
        return [Flush(), Emit("output_audio_buffer.cleared", {"response_id": rid})]

    def _item_create(self, ev: dict[str, Any], v: View, now: float) -> list[Effect]:
        prev = ev.get("previous_item_id")
        if prev is not None and prev != ROOT and _find(v.conversation, prev) is None:
            raise ProtocolError(
                f"previous_item_id {prev!r} is not in the conversation",
                code="item_not_found",
                param="previous_item_id",
            )
        return [AddItem(ev.get("item"), prev, v.settings)]

    def _item_truncate(self, ev: dict[str, Any], v: View, now: float) -> list[Effect]:
        item_id, ms = ev.get("item_id"), ev.get("audio_end_ms")
        if not isinstance(ms, int) or isinstance(ms, bool) or ms < 0:
            raise ProtocolError("audio_end_ms must be a non-negative integer", param="audio_end_ms")
        if ev.get("content_index", 0) != 0:
            raise ProtocolError("content_index must be 0", param="content_index")
        item = _find(v.conversation, item_id)
        if item is None:
            raise ProtocolError(
                f"item {item_id!r} not found", code="item_not_found", param="item_id"
            )
        if item.role != "assistant":
            raise ProtocolError("only assistant items can be truncated", param="item_id")
        if ms > item.audio_ms + TRUNCATE_SLACK_MS:
            raise ProtocolError(
                f"audio_end_ms {ms} is past the item's audio ({item.audio_ms:.0f} ms)",
                param="audio_end_ms",
            )
        effects: list[Effect] = []
        active = v.responding
        if active is not None and active.item is item:  # the client cut the answer
            effects.append(CancelResponse("client_cancelled", speech_goes_on=True))
        return [*effects, Flush(item.id), TruncateItem(item.id, ms)]

    def _item_delete(self, ev: dict[str, Any], v: View, now: float) -> list[Effect]:
        item = _find(v.conversation, ev.get("item_id"))
        if item is None:
            raise ProtocolError("item not found", code="item_not_found", param="item_id")
        return [DeleteItem(item.id)]

    def _item_retrieve(self, ev: dict[str, Any], v: View, now: float) -> list[Effect]:
        item = _find(v.conversation, ev.get("item_id"))
        if item is None:
            raise ProtocolError("item not found", code="item_not_found", param="item_id")
        return [Emit("conversation.item.retrieved", {"item": item.to_openai()})]

    def _response_create(self, ev: dict[str, Any], v: View, now: float) -> list[Effect]:
        spec = ev.get("response") or {}
        if not isinstance(spec, dict):
            raise ProtocolError("response must be an object", param="response")
        over: dict[str, Any] = {}
        if spec:
            # A response's own settings: refused whole if a field is, so that no response
            # starts other than asked.
            s, refused = apply_session_update(v.settings, spec, v.voices, where="response")
            if refused:
                raise refused[0]
            for key in RESPONSE_FIELDS:
                if getattr(s, key) != getattr(v.settings, key):
                    over[key] = getattr(s, key)
            over["metadata"] = parse_metadata(spec.get("metadata"), "response.metadata")
        if v.responding is not None:
            raise ProtocolError(
                f"the conversation already has an active response ({v.responding.id})",
                code="conversation_already_has_active_response",
            )
        return [StartResponse(over)]

    def _response_cancel(self, ev: dict[str, Any], v: View, now: float) -> list[Effect]:
        rid, active = ev.get("response_id"), v.responding
        if active is None or active.ending or (rid is not None and rid != active.id):
            raise ProtocolError(
                "Cancellation failed: no active response found", code="response_cancel_not_active"
            )
        return [CancelResponse("client_cancelled")]


def _find(conversation: Conversation, item_id: Any) -> Item | None:
    """The item a client names, if it is in the conversation."""
    if not isinstance(item_id, str):
        return None
    try:
        return conversation.get(item_id)
    except KeyError:
        return None


def read_event(raw: str, max_bytes: int) -> Any:
    """A client message as a transport receives it (JSON text), parsed; `ProtocolError` when it
    is larger than `max_bytes`, not JSON, or its `event_id` is not one (`checked_event_id`)."""
    if len(raw) > max_bytes:
        raise ProtocolError(
            f"message of {len(raw)} bytes exceeds the limit of {max_bytes} bytes; send audio in "
            "smaller appends",
            code="message_too_large",
        )
    event = loads(raw)
    checked_event_id(event)
    return event


def error(e: ProtocolError, client_event_id: str | None = None) -> dict[str, Any]:
    """The `error` server event for a refusal."""
    return error_event(str(e), e.code, e.param, client_event_id)


_DECISIONS = {
    "session.update": ClientEvents._session_update,
    "input_audio_buffer.append": ClientEvents._append,
    "input_audio_buffer.commit": ClientEvents._commit,
    "input_audio_buffer.clear": ClientEvents._clear,
    "output_audio_buffer.clear": ClientEvents._output_clear,
    "conversation.item.create": ClientEvents._item_create,
    "conversation.item.truncate": ClientEvents._item_truncate,
    "conversation.item.delete": ClientEvents._item_delete,
    "conversation.item.retrieve": ClientEvents._item_retrieve,
    "response.create": ClientEvents._response_create,
    "response.cancel": ClientEvents._response_cancel,
}
