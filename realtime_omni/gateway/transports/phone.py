"""What every phone transport (the media-stream bridges, SIP) does alike around its `Session`:
the route's session settings with the call's own laid over them, and the session's events,
which nobody reads on a phone but which say when the caller last spoke and when an idle call's
goodbye is over.

    await apply_settings(session, config, "twilio", {"voice": "Ethan"})
    await watch(session, config, "twilio")      # returns when the call should be hung up
"""

from __future__ import annotations

import logging
import time
from typing import Any

from realtime_omni.aio import within
from realtime_omni.gateway.config import PhoneConfig, merge
from realtime_omni.gateway.media.audio import INPUT_RATE_HZ
from realtime_omni.gateway.protocol.events import ProtocolError, loads
from realtime_omni.gateway.session.driver import Session

log = logging.getLogger(__name__)
RATE_HZ = 8000  # G.711 narrowband, both ways
FRAME_SAMPLES = 160  # 20 ms


async def apply_settings(
    session: Session, config: PhoneConfig, route: str, params: dict[str, str]
) -> None:
    """The route's `session` settings, then the call's parameters (`instructions`, `voice`, and
    `session`: a JSON session object) over them, applied as a `session.update` would be. Each
    field refused is logged, and the call goes on with the others."""
    settings = config.session_for(route)
    if "session" in params:
        try:
            over = loads(params["session"], "the `session` parameter")
            settings = merge(settings, over if isinstance(over, dict) else {})
        except ProtocolError as e:
            log.warning("%s call: %s", route, e)
    for key in ("instructions", "voice"):
        if key in params:
            settings = merge(settings, {key: params[key]})
    if settings:
        try:
            refused = session.configure(settings)
        except ProtocolError as e:  # not an object at all
            refused = [e]
        for bad in refused:  # the rest applied
            log.warning("%s call: a session setting was refused: %s", route, bad)


def items_summary(session: Session) -> list[dict[str, Any]]:
    """The conversation as /v1/stats shows a phone call's: per item its role, status and audio
    length (for a user item, the audio committed; for the bot's, what was kept)."""
    out = []
    for it in session.conversation.items:
        ms = it.audio_ms
        if it.role == "user":
            ms = sum(len(p.audio) for p in it.parts if p.audio is not None) * 1000 // INPUT_RATE_HZ
        out.append({"id": it.id, "role": it.role, "status": it.status, "audio_ms": ms})
    return out


async def watch(session: Session, config: PhoneConfig, route: str) -> None:
    """Drain the session's events; return once the call has been idle (no speech, no answer)
    for `idle_timeout_s` and its goodbye is over (or `goodbye_max_s` passed)."""
    idle = config.idle_timeout_s
    last = time.monotonic()
    goodbye_at: float | None = None
    while True:
        try:
            ev = await within(session.next_event(), 0.5)
        except TimeoutError:
            ev = None
        now = time.monotonic()
        kind = ev["type"] if ev else ""
        if session.active_response is not None or session.input_speaking:
            last = now
        if kind.startswith("input_audio_buffer.") or kind == "response.done":
            last = now  # speech, a key press, an answer's end
        if goodbye_at is not None:
            if session.active_response is None or now - goodbye_at > config.goodbye_max_s:
                return
            continue
        if idle is None or now - last <= idle:
            continue
        log.info("%s call: idle for %.0f s; ending it", route, idle)
        goodbye_at = now
        if not config.goodbye_instructions:
            return
        try:
            await session.handle(
                {
                    "type": "response.create",
                    "response": {"instructions": config.goodbye_instructions},
                }
            )
        except ProtocolError:
            return
