"""Carrying out what a client event's decision asks (`client_events.ClientEvents.decide`) on a
session: the I/O half of the client events, kept out of the driver.

    await carry_out(session, effect)            # one effect, in the order decided
    err = await handle_text(session, raw, n)    # a transport's raw message, to an error or None
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from realtime_omni.gateway.protocol.events import (
    INLINE_JSON_BYTES,
    ProtocolError,
    decode_b64,
    error_event,
    parse_item,
)
from realtime_omni.gateway.protocol.settings import Settings
from realtime_omni.gateway.session.client_events import (
    AddItem,
    CancelResponse,
    ClearInput,
    CommitAudio,
    DeleteItem,
    Effect,
    Emit,
    Flush,
    PushAudio,
    SetSettings,
    StartResponse,
    TruncateItem,
    error,
    read_event,
)

if TYPE_CHECKING:
    from realtime_omni.gateway.session.driver import Session

log = logging.getLogger(__name__)
BIG_B64 = 1 << 20  # base64 text longer than this is decoded in a worker thread


async def handle_text(s: Session, raw: str, max_bytes: int) -> dict[str, Any] | None:
    """`handle` one client message as a transport receives it (JSON text); the `error`
    event to send back when it is too big, not JSON, refused or failed, else None."""
    try:
        if len(raw) > INLINE_JSON_BYTES:  # off the event loop: other calls' audio goes on
            event = await asyncio.to_thread(read_event, raw, max_bytes)
        else:
            event = read_event(raw, max_bytes)
    except ProtocolError as e:
        return error(e)
    client_id = event.get("event_id") if isinstance(event, dict) else None  # read_event checked
    try:
        await s.handle(event)
    except ProtocolError as e:
        return error(e, client_id)
    except Exception:  # a bug must cost the client an error event, not the connection
        log.exception("session %s: event %r failed", s.id, event.get("type"))
        return error_event(  # Python's own words stay in the log, not with the client
            "the server failed to handle this event; it logged why", "server_error", None,
            client_id, "server_error",
        )  # fmt: skip
    return None


async def carry_out(s: Session, effect: Effect) -> None:
    """Carry out what a client event's decision asks."""
    match effect:
        case Emit(type=kind, fields=fields):
            s._emit(kind, **fields)
        case SetSettings(settings=settings):
            s._apply(settings)
        case PushAudio(audio=audio, settings=settings):
            await _push_b64(s, audio, settings)
        case ClearInput():
            s._clear_input()
        case CommitAudio(pcm=pcm, item_id=item_id):
            s._commit_audio(pcm, item_id)
        case Flush(item_id=item_id):
            s._flush(item_id)
        case AddItem(item=raw, previous_item_id=prev, settings=settings):
            # Off the event loop: base64, audio conversion and image decoding of a large
            # item (a 6000x6000 PNG took 0.34 s) must not stall every other call's audio.
            item = await asyncio.to_thread(parse_item, raw, settings.input_format)
            s._emit_item_added(item, s._add(item, prev))
        case CancelResponse(reason=reason, speech_goes_on=goes_on):
            if goes_on and s.turns.truncated():  # the speech over it: the next turn
                s.playout.paused = False  # the next answer plays
            await s.cancel_response(reason)
        case TruncateItem(item_id=item_id, audio_end_ms=ms):
            _truncate(s, item_id, ms)
        case DeleteItem(item_id=item_id):
            s.conversation.delete(item_id)
            s._deleted(item_id)
        case StartResponse(overrides=overrides):
            s.responses.start(overrides, time.monotonic())


async def _push_b64(s: Session, audio: str, settings: Settings) -> None:
    fmt = settings.input_format
    if len(audio) > BIG_B64:  # megabytes: off the event loop
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
        s.push_audio(pcm[i : i + step], fmt.rate_hz, paid=True)  # `ClientEvents._append` took it


def _truncate(s: Session, item_id: str, ms: int) -> None:
    """Cut an assistant item to a client's playback position. One past its audio (the
    decision allowed `TRUNCATE_SLACK_MS`: rounded up, a frame late; or past what the cancel
    before it kept of the answer) keeps all of it."""
    item = s.conversation.get(item_id)
    ms = min(ms, int(item.audio_ms))
    item.truncate(ms)
    s._emit("conversation.item.truncated", item_id=item.id, content_index=0, audio_end_ms=ms)
