"""The server events of one connection as they go on the wire, for every transport that speaks
OpenAI's events (the WebSocket, a call's sideband, WebRTC's data channel).

    channel = EventChannel(session, host.event_log, "websocket", beta=False)
    for event in channel.opening():        # session.created (and a beta client's conversation)
        await send(event)
    wire = channel.outgoing(event)         # a session event: with its event_id, in the log;
    if wire is not None:                   # None: not for this client (a beta client's GA-only)
        await send(wire)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from realtime_omni.gateway.protocol.events import event_id, for_beta

if TYPE_CHECKING:
    from realtime_omni.gateway.event_log import EventLog
    from realtime_omni.gateway.session.driver import Session


class EventChannel:
    """Beta names for a beta client, an `event_id` on every event, the event log. `label` is the
    event log's name for the connection (websocket, sideband, webrtc)."""

    def __init__(
        self, session: Session, event_log: EventLog | None, label: str, beta: bool = False
    ) -> None:
        self.session, self.event_log, self.label, self.beta = session, event_log, label, beta

    def opening(self, resume: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """What a new connection is told first; `resume`: session.created's extension field
        for a resumable session (`resume.py`)."""
        s = self.session
        created = {"type": "session.created", "session": s.settings.to_openai(s.id)}
        out: list[dict[str, Any]] = [created if resume is None else {**created, "resume": resume}]
        if self.beta:  # beta clients wait for their conversation; GA ones never heard of it
            conversation = {"id": f"conv_{s.id[5:]}", "object": "realtime.conversation"}
            out.append({"type": "conversation.created", "conversation": conversation})
        return out

    def outgoing(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """`event` as it is sent, logged; None when this client is not to get it."""
        if self.beta:
            if event["type"] in ("session.created", "session.updated"):
                s = self.session
                event = dict(event, session=s.settings.to_openai(s.id, True))
            converted = for_beta(event)
            if converted is None:
                return None
            event = converted
        event = {"event_id": event_id(), **event}
        if self.event_log is not None:
            self.event_log.write(self.session.id, self.label, self.beta, event)
        return event


def message_text(msg: Mapping[str, Any]) -> str:
    """A received WebSocket message's text (a binary frame's bytes decoded as UTF-8)."""
    raw = msg.get("text")
    return raw if raw is not None else (msg.get("bytes") or b"").decode("utf-8", "replace")


def closed_by_client(msg: Mapping[str, Any]) -> bool:
    """Whether a `websocket.disconnect` is the client's own close (a close frame, whatever its
    code) rather than a lost connection: uvicorn's websockets-sansio says 1005 with no reason
    for a lost connection, and gives a close frame's reason ("" for none) with its code."""
    code = msg.get("code")
    return code in (1000, 1001) or ("reason" in msg and code != 1006)
