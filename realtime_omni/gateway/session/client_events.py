"""The OpenAI Realtime client events a `Session` takes: `handle` (a parsed event), `handle_text`
(a transport's raw message), and one method per event type. They act on their session: its
settings, input buffer, conversation, playout and responses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from realtime_omni.gateway.media.audio import INPUT_RATE_HZ
from realtime_omni.gateway.protocol.conversation import new_id
from realtime_omni.gateway.protocol.events import (
    ProtocolError,
    decode_b64,
    error_event,
    loads,
    parse_item,
    parse_metadata,
)
from realtime_omni.gateway.protocol.settings import apply_session_update

if TYPE_CHECKING:
    from realtime_omni.gateway.session.driver import Session

log = logging.getLogger(__name__)
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
TRUNCATE_SLACK_MS = 40  # a truncate this far past an item's audio keeps all of it
MIN_COMMIT_MS = 100  # OpenAI refuses to commit less
BIG_B64 = 1 << 20  # base64 text longer than this is decoded in a worker thread


class ClientEvents:
    """A session's client events; no state of its own."""

    def __init__(self, session: Session) -> None:
        self.s = session

    async def handle(self, event: Any) -> None:
        """Apply one client event. Raises `ProtocolError` for one it refuses."""
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            raise ProtocolError("an event must be a JSON object with a string `type`", param="type")
        kind = event["type"]
        handler = _HANDLERS.get(kind)
        if handler is None:
            raise ProtocolError(f"unknown event type {kind!r}", code="invalid_event", param="type")
        await handler(self, event)

    async def handle_text(self, raw: str, max_bytes: int) -> dict[str, Any] | None:
        """`handle` one client message as a transport receives it (JSON text); gives the `error`
        event to send back when it is too big, not JSON, refused or failed, else None."""
        if len(raw) > max_bytes:
            return _error(
                ProtocolError(
                    f"message of {len(raw)} bytes exceeds the limit of {max_bytes} bytes; send "
                    "audio in smaller appends",
                    code="message_too_large",
                )
            )
        try:
            event = loads(raw)
        except ProtocolError as e:
            return _error(e)
        client_id = event.get("event_id") if isinstance(event, dict) else None
        client_id = client_id if isinstance(client_id, str) else None
        try:
            await self.handle(event)
        except ProtocolError as e:
            return _error(e, client_id)
        except Exception:  # a bug must cost the client an error event, not the connection
            log.exception("session %s: event %r failed", self.s.id, event.get("type"))
            return error_event(  # Python's own words stay in the log, not with the client
                "the server failed to handle this event; it logged why", "server_error", None,
                client_id, "server_error",
            )  # fmt: skip
        return None

    async def _session_update(self, ev: dict[str, Any]) -> None:
        """What parses is applied; each field refused is one `error` naming it, before the
        `session.updated` that shows what the session now is."""
        for e in self.s.configure(ev.get("session")):
            self.s._emit("error", error=_error(e, ev.get("event_id"))["error"])
        self.s._emit("session.updated", session=self.s.settings.to_openai(self.s.id))

    async def _append(self, ev: dict[str, Any]) -> None:
        audio = ev.get("audio")
        fmt = self.s.settings.input_format
        if isinstance(audio, str):  # its length, judged before any decoding
            seconds = len(audio) * 3 // 4 / (2 if fmt.name == "pcm16" else 1) / fmt.rate_hz
            credit = self.s.input_credit
            if not credit.take(seconds, time.monotonic()):
                raise ProtocolError(
                    f"audio is coming faster than {credit.speed:g}x real time (after a first "
                    f"{credit.burst_s:g} s): this append of {seconds:.1f} s was dropped; send "
                    "audio about as fast as it is spoken",
                    code="rate_limit_exceeded",
                    param="audio",
                )
        if isinstance(audio, str) and len(audio) > BIG_B64:  # megabytes: off the event loop
            data = await asyncio.to_thread(decode_b64, audio, "audio")
        else:
            data = decode_b64(audio, "audio")
        pcm = fmt.decode(data)
        # Half a second at a time, yielding between: a long append's resampling never holds the
        # event loop (every other call's audio) for more than a fraction of a millisecond.
        step = fmt.rate_hz // 2
        for i in range(0, len(pcm), step):
            if i:
                await asyncio.sleep(0)
            self.s.push_audio(pcm[i : i + step], fmt.rate_hz)

    async def _commit(self, ev: dict[str, Any]) -> None:
        pcm = self.s.input.slice(self.s.input.start, self.s.input.end)
        if len(pcm) * 1000 < MIN_COMMIT_MS * INPUT_RATE_HZ:
            raise ProtocolError(
                f"buffer too small: expected at least {MIN_COMMIT_MS} ms of audio, "
                f"got {len(pcm) * 1000 / INPUT_RATE_HZ:.0f} ms",
                code="input_audio_buffer_commit_empty",
            )
        item_id = self.s.turns.turn_item_id or new_id("item")
        self.s._clear_input()
        self.s._commit_audio(pcm, item_id)

    async def _clear(self, ev: dict[str, Any]) -> None:
        self.s._clear_input()
        self.s._emit("input_audio_buffer.cleared")

    async def _output_clear(self, ev: dict[str, Any]) -> None:
        self.s._flush()
        rid = self.s.active_response or self.s.responses.last_id
        if rid is not None:  # nothing was ever played: no buffer to have cleared
            self.s._emit("output_audio_buffer.cleared", response_id=rid)

    async def _item_create(self, ev: dict[str, Any]) -> None:
        # Off the event loop: base64, audio conversion and image decoding of a large item (a
        # 6000x6000 PNG took 0.34 s) must not stall every other call's audio.
        item = await asyncio.to_thread(parse_item, ev.get("item"), self.s.settings.input_format)
        prev = ev.get("previous_item_id")
        try:
            prev = self.s._add(item, prev)
        except KeyError:
            raise ProtocolError(
                f"previous_item_id {prev!r} is not in the conversation",
                code="item_not_found",
                param="previous_item_id",
            ) from None
        self.s._emit_item_added(item, prev)

    async def _item_truncate(self, ev: dict[str, Any]) -> None:
        item_id, ms = ev.get("item_id"), ev.get("audio_end_ms")
        if not isinstance(ms, int) or isinstance(ms, bool) or ms < 0:
            raise ProtocolError("audio_end_ms must be a non-negative integer", param="audio_end_ms")
        if ev.get("content_index", 0) != 0:
            raise ProtocolError("content_index must be 0", param="content_index")
        try:
            item = self.s.conversation.get(_item_id(item_id))
        except KeyError:
            raise ProtocolError(
                f"item {item_id!r} not found", code="item_not_found", param="item_id"
            ) from None
        if item.role != "assistant":
            raise ProtocolError("only assistant items can be truncated", param="item_id")
        if self.s.responses.active is not None and self.s.responses.active.item is item:
            if self.s.turns.truncated():  # the speech over it goes on as the next turn
                self.s.playout.paused = False  # the next answer plays
            await self.s.cancel_response("client_cancelled")
        self.s._flush(item.id)
        if item.audio_ms < ms <= item.audio_ms + TRUNCATE_SLACK_MS:
            ms = int(item.audio_ms)  # a client's playback position, rounded up or a frame late
        try:
            item.truncate(ms)
        except ValueError as e:
            raise ProtocolError(str(e), param="audio_end_ms") from None
        self.s._emit(
            "conversation.item.truncated", item_id=item.id, content_index=0, audio_end_ms=ms
        )

    async def _item_delete(self, ev: dict[str, Any]) -> None:
        try:
            self.s.conversation.delete(_item_id(ev.get("item_id")))
        except KeyError:
            raise ProtocolError("item not found", code="item_not_found", param="item_id") from None
        self.s._deleted(ev["item_id"])

    async def _item_retrieve(self, ev: dict[str, Any]) -> None:
        try:
            item = self.s.conversation.get(_item_id(ev.get("item_id")))
        except KeyError:
            raise ProtocolError("item not found", code="item_not_found", param="item_id") from None
        self.s._emit("conversation.item.retrieved", item=item.to_openai())

    async def _response_create(self, ev: dict[str, Any]) -> None:
        spec = ev.get("response") or {}
        if not isinstance(spec, dict):
            raise ProtocolError("response must be an object", param="response")
        over: dict[str, Any] = {}
        if spec:
            # A response's own settings: refused whole if a field is, so that no response
            # starts other than asked.
            s, refused = apply_session_update(
                self.s.settings, spec, self.s.voices, where="response"
            )
            if refused:
                raise refused[0]
            for key in RESPONSE_FIELDS:
                if getattr(s, key) != getattr(self.s.settings, key):
                    over[key] = getattr(s, key)
            over["metadata"] = parse_metadata(spec.get("metadata"), "response.metadata")
        self.s.responses.start(over, time.monotonic())

    async def _response_cancel(self, ev: dict[str, Any]) -> None:
        rid = ev.get("response_id")
        active = self.s.responses.active
        if active is None or active.ending or (rid is not None and rid != active.id):
            raise ProtocolError(
                "Cancellation failed: no active response found", code="response_cancel_not_active"
            )
        await self.s.cancel_response("client_cancelled")


def _item_id(value: Any) -> str:
    """A client's `item_id`; KeyError (no such item) when it is not a string."""
    if not isinstance(value, str):
        raise KeyError(value)
    return value


def _error(e: ProtocolError, client_event_id: str | None = None) -> dict[str, Any]:
    return error_event(str(e), e.code, e.param, client_event_id)


_HANDLERS: dict[str, Callable[[Any, dict[str, Any]], Any]] = {
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
