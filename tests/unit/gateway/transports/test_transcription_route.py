"""How a transcription session is asked for, through the whole app on real sockets: the
WebSocket's `intent=transcription`, a client secret's `session.type`, and the refusal of an
update that would turn a realtime session into one."""

from __future__ import annotations

import json

from tests.unit.gateway.app_harness import bearer, gateway_server, recv_json

KEY = "sk-unit-0123"
TRANSCRIPTION = {"type": "transcription", "audio": {"input": {"transcription": {"language": "en"}}}}


def test_the_transcription_intent_makes_a_transcription_session() -> None:
    with (
        gateway_server(keys=KEY) as srv,
        srv.websocket("/v1/realtime?intent=transcription", bearer(KEY)) as ws,
    ):
        created = recv_json(ws)
        assert created["type"] == "session.created"
        assert created["session"]["type"] == "transcription"
        assert created["session"]["object"] == "realtime.transcription_session"
        ws.send(json.dumps({"type": "session.update", "session": TRANSCRIPTION}))
        updated = recv_json(ws)
        assert updated["type"] == "session.updated"
        assert updated["session"]["audio"]["input"]["transcription"]["language"] == "en"
        ws.send(json.dumps({"type": "response.create", "event_id": "ev_1"}))
        err = recv_json(ws)["error"]
        assert (err["code"], err["param"], err["event_id"]) == ("invalid_value", "type", "ev_1")


def test_a_client_secret_for_a_transcription_session_makes_one_without_the_intent() -> None:
    with gateway_server(keys=KEY) as srv:
        status, body = srv.post_json(
            "/v1/realtime/client_secrets", {"session": TRANSCRIPTION}, bearer(KEY)
        )
        assert status == 200 and body["session"]["type"] == "transcription", body
        with srv.websocket("/v1/realtime", bearer(body["value"])) as ws:
            session = recv_json(ws)["session"]
            assert session["type"] == "transcription"
            assert session["audio"]["input"]["transcription"]["language"] == "en"
        # A secret's transcription session with a realtime session's field is refused at once.
        bad = {**TRANSCRIPTION, "instructions": "answer me"}
        status, body = srv.post_json("/v1/realtime/client_secrets", {"session": bad}, bearer(KEY))
        assert status == 400 and "session.instructions" in body["error"]["message"], body


def test_a_realtime_session_refuses_a_transcription_update_and_stays_as_it_was() -> None:
    with (
        gateway_server(keys=KEY) as srv,
        srv.websocket("/v1/realtime?model=qwen3-omni", bearer(KEY)) as ws,
    ):
        assert recv_json(ws)["session"]["type"] == "realtime"
        ws.send(json.dumps({"type": "session.update", "session": TRANSCRIPTION}))
        err = recv_json(ws)["error"]
        assert err["code"] == "invalid_parameter" and err["param"] == "session.type"
        assert "transcription session update event to a realtime session" in err["message"]
        ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime"}}))
        assert recv_json(ws)["session"]["type"] == "realtime"
