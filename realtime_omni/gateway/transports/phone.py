"""What every phone transport (the media-stream bridges, SIP) does alike around its `Session`:
the route's session settings with the call's own laid over them, and the session's events,
which nobody reads on a phone but which say when the caller last spoke and when an idle call's
goodbye is over.

    await apply_settings(session, config, "twilio", {"voice": "Ethan"})
    await watch(session, config, "twilio")      # returns when the call should be hung up
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import time
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import Request

from realtime_omni.aio import within
from realtime_omni.gateway.config import PhoneConfig, merge
from realtime_omni.gateway.protocol import ProtocolError, loads
from realtime_omni.gateway.session import Session

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
        for e in refused:  # the rest applied
            log.warning("%s call: a session setting was refused: %s", route, e)


def public_http_url(request: Request, config: PhoneConfig) -> str:
    """The URL a provider requested, as it named it (what Twilio signs): `phone.public_url` made
    http(s), else this request's host behind `X-Forwarded-Proto`; then the path and query."""
    if config.public_url:
        base = config.public_url.rstrip("/")
        base = "http" + base[2:] if base.startswith("ws") else base  # ws -> http, wss -> https
    else:
        proto = request.headers.get("x-forwarded-proto", request.url.scheme)
        host = request.headers.get("x-forwarded-host") or request.headers.get("host", "localhost")
        base = f"{proto}://{host}"
    query = request.url.query
    return base + request.url.path + (f"?{query}" if query else "")


def twilio_signature(token: str, url: str, form: dict[str, list[str]]) -> str:
    """Twilio's X-Twilio-Signature: HMAC-SHA1 of the URL and the form's fields sorted by name,
    each name followed by its value, keyed by the account's auth token, in base64."""
    data = url + "".join(k + v for k in sorted(form) for v in sorted(form[k]))
    mac = hmac.new(token.encode(), data.encode(), hashlib.sha1).digest()
    return base64.b64encode(mac).decode()


def twilio_signature_ok(
    token: str, url: str, form: dict[str, list[str]], given: str | None
) -> bool:
    """Whether `given` signs this request; the URL with and without its scheme's default port,
    as Twilio's own validator tries (which Twilio signs depends on how the number's URL was
    written)."""
    if not given:
        return False
    parts = urlsplit(url)
    default = {"https": 443, "http": 80}.get(parts.scheme)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    bare = parts._replace(netloc=host).geturl()
    ported = parts._replace(netloc=f"{host}:{parts.port or default}").geturl()
    return any(
        hmac.compare_digest(
            twilio_signature(token, u, form).encode(), given.encode("utf-8", "replace")
        )
        for u in {url, bare, ported}
    )


def items_summary(session: Session) -> list[dict[str, Any]]:
    """The conversation as /v1/stats shows a phone call's: per item its role, status and audio
    length (for a user item, the audio committed; for the bot's, what was kept)."""
    out = []
    for it in session.conversation.items:
        ms = it.audio_ms
        if it.role == "user":
            ms = sum(len(p.audio) for p in it.parts if p.audio is not None) * 1000 // 16000
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
