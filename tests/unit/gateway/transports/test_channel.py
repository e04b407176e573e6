"""The event channel every OpenAI-event transport sends through, and the session life every
transport shares (`host.admit` / `host.release`), without a socket."""

from __future__ import annotations

from typing import Any

from realtime_omni.gateway.auth import Auth
from realtime_omni.gateway.host import admit, release
from realtime_omni.gateway.session.driver import Session
from realtime_omni.gateway.transports.channel import EventChannel
from tests.conftest import run
from tests.unit.gateway.fakes import FakeCoord


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, bool, dict[str, Any]]] = []

    def write(self, session_id: str, label: str, beta: bool, event: dict[str, Any]) -> None:
        self.lines.append((session_id, label, beta, event))


def test_ga_events_get_an_id_and_are_logged() -> None:
    s, log = Session(FakeCoord()), Log()
    ch = EventChannel(s, log, "webrtc")  # type: ignore[arg-type]
    (created,) = ch.opening()
    assert created["type"] == "session.created" and created["session"]["id"] == s.id
    wire = ch.outgoing({"type": "conversation.item.done", "item": {}})
    assert wire is not None and wire["event_id"].startswith("event_")
    assert log.lines == [(s.id, "webrtc", False, wire)]


def test_a_beta_client_gets_beta_names_its_conversation_and_no_ga_only_event() -> None:
    s = Session(FakeCoord())
    ch = EventChannel(s, None, "websocket", beta=True)
    assert [e["type"] for e in ch.opening()] == ["session.created", "conversation.created"]
    assert ch.outgoing({"type": "conversation.item.done", "item": {}}) is None
    wire = ch.outgoing({"type": "response.output_audio.done", "response_id": "r", "item_id": "i"})
    assert wire is not None and wire["type"] == "response.audio.done"


class FakeHost:
    def __init__(self) -> None:
        self.sessions: set[Session] = set()
        self.forgotten: list[Session] = []
        self.auth = Auth()

    def new_session(
        self, model: str, output_rate_hz: int | None, transport: str, owner: str
    ) -> Session:
        s = Session(FakeCoord(), output_rate_hz=output_rate_hz, transport=transport)
        s.owner = owner
        return s

    def forget(self, session: Session) -> None:
        self.sessions.discard(session)
        self.forgotten.append(session)


def test_admit_counts_the_session_at_once_and_release_closes_and_forgets_it() -> None:
    async def body() -> None:
        host = FakeHost()
        s = admit(host, transport="sip", owner="k")  # type: ignore[arg-type]
        assert host.sessions == {s} and s.transport == "sip" and s.owner == "k"
        await s.start()
        await release(host, s)  # type: ignore[arg-type]
        await release(host, s)  # type: ignore[arg-type]  # twice is safe
        assert host.sessions == set() and host.forgotten == [s, s]

    run(body())
