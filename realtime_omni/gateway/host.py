"""What a transport needs of the server it runs in, and the part of a session's life that every
transport repeats.

    if (refused := host.refusal(grant)) is not None:   # (message, code): tell the caller, stop
        ...
    session = admit(host, transport="sip", owner=grant.owner)   # made and counted, not started
    try:
        await session.start()
        ...                                            # the transport's own media and events
    finally:
        await release(host, session)                   # closed and forgotten, whatever happened

`Host` is a Protocol: `app.Gateway` is the server's, a test may pass any object with these
members. The transports import this module, never `app`, so the app composes them and not the
other way round.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from realtime_omni.gateway.auth import Auth, Grant
    from realtime_omni.gateway.config import GatewayConfig
    from realtime_omni.gateway.event_log import EventLog
    from realtime_omni.gateway.protocol.settings import Voices
    from realtime_omni.gateway.session.driver import Session
    from realtime_omni.gateway.transports.resume import Resumes


class Host(Protocol):
    config: GatewayConfig
    auth: Auth
    voices: Voices  # the voice names a session takes
    event_log: EventLog | None  # `serve --event-log`: every event sent and received
    sessions: set[Session]  # the live ones, counted against the limits
    draining: bool  # SIGTERM: no new session; live ones go on
    resumes: Resumes  # the WebSocket sessions a dropped connection left, waiting for a resume

    def refusal(self, grant: Grant | None = None) -> tuple[str, str] | None:
        """Why a new session for `grant` cannot start now, as (message, code); None: it can."""
        ...

    def new_session(
        self,
        model: str = "qwen3-omni",
        output_rate_hz: int | None = None,
        transport: str = "websocket",
        owner: str = "open",
    ) -> Session:
        """A new session, not yet started nor counted."""
        ...

    def forget(self, session: Session) -> None:
        """A session ended: keep its measurements, let go of it."""
        ...


def admit(
    host: Host,
    model: str = "qwen3-omni",
    output_rate_hz: int | None = None,
    transport: str = "websocket",
    owner: str = "open",
) -> Session:
    """A new session, counted at once (before any await, so the limits hold under a burst of
    callers); the caller checked `host.refusal` first, and starts it."""
    session = host.new_session(model, output_rate_hz, transport, owner)
    host.sessions.add(session)
    host.auth.count_start(owner)
    return session


async def release(host: Host, session: Session) -> None:
    """Close an admitted session (aborting what runs; safe twice) and forget it, even when the
    close fails."""
    try:
        await session.close()
    finally:
        host.forget(session)
