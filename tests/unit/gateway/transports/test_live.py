"""OpenAI's Live API: the translation (`protocol/live.py`, no I/O) and the WebSocket route around
it (`transports/live.py`, the real app on a fake pipeline)."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import numpy as np
import pytest

from realtime_omni.gateway.protocol.events import ProtocolError
from realtime_omni.gateway.protocol.live import (
    DELEGATE,
    LiveError,
    LiveProtocol,
    Step,
    parse_start,
)
from realtime_omni.gateway.protocol.settings import Voices
from tests.unit.gateway.app_harness import bearer, gateway_server, recv_json, refused

START = {"model": "gpt-live-1", "instructions": "Be brief.", "delegation": {"type": "client"}}


def live(**start: Any) -> LiveProtocol:
    return LiveProtocol(parse_start({**START, **start}, Voices()), started_s=0.0)


def call_done(call_id: str = "call_1", request: str = "the weather") -> dict[str, Any]:
    item = {"type": "function_call", "name": DELEGATE, "call_id": call_id}
    item["arguments"] = json.dumps({"request": request})
    return {"type": "response.output_item.done", "item": {"id": "item_9", **item}}


# ---- session.start -------------------------------------------------------------------------


def test_start_configures_the_session_with_transcription_and_the_delegate_function() -> None:
    cfg = parse_start(
        {
            **START,
            "audio": {"format": {"type": "audio/pcm", "rate": 16000}, "output": {"voice": "marin"}},
            "input": [
                {"type": "message", "role": "developer", "content": [
                    {"type": "input_text", "text": "Speak French."}]},
                {"type": "message", "role": "assistant", "content": [
                    {"type": "output_text", "text": "Bonjour."}]},
            ],
        },
        Voices(),
    )  # fmt: skip
    rt = cfg.realtime_session()
    assert rt["instructions"] == "Be brief." and rt["audio"]["output"] == {"voice": "marin"}
    assert rt["audio"]["input"]["transcription"] == {}
    assert [t["name"] for t in rt["tools"]] == [DELEGATE]
    assert "turn_detection" not in rt  # the server's own turn-taking, as configured
    assert cfg.format.rate_hz == 16000
    items = [e["item"] for e in cfg.history_events()]
    assert [(i["role"], i["content"][0]["type"]) for i in items] == [
        ("system", "input_text"),
        ("assistant", "output_text"),
    ]
    assert cfg.to_live("sess_1", 0)["delegation"] == {"type": "client"}


@pytest.mark.parametrize(
    ("session", "param", "code"),
    [
        ({"delegation": {"type": "responses", "responses": {"model": "gpt-5"}}},
         "session.delegation.type", "unsupported_delegation"),
        ({"store": True}, "session.store", "invalid_value"),
        ({"turn_detection": None}, "session.turn_detection", "invalid_value"),
        ({"audio": {"output": {"voice": "nobody"}}}, "session.audio.output.voice",
         "invalid_value"),
        ({"audio": {"format": {"type": "audio/pcm", "rate": 44100}}},
         "session.audio.format.rate", "invalid_value"),
        ({"model": ""}, "session.model", "invalid_value"),
        ({"input": [{"role": "system", "content": [{"type": "input_text", "text": "x"}]}]},
         "session.input[0].role", "invalid_value"),
    ],
)  # fmt: skip
def test_what_cannot_be_served_is_refused_at_start_by_name(
    session: dict[str, Any], param: str, code: str
) -> None:
    with pytest.raises(ProtocolError) as e:
        parse_start({**START, **session}, Voices())
    assert e.value.param == param and e.value.code == code
    assert param.split(".")[-1].split("[")[0] in str(e.value)


# ---- client events ------------------------------------------------------------------------


def test_audio_is_decoded_and_a_mute_keeps_the_clock_with_silence() -> None:
    p = live()
    pcm = (np.full(480, 0.25) * 32767).astype("<i2").tobytes()
    append = {"type": "session.input_audio.append", "audio": base64.b64encode(pcm).decode()}
    step = p.client(append, 0)
    assert step.audio is not None and len(step.audio) == 480 and step.audio.max() > 0.2
    ack = p.client({"type": "session.input_audio.mute", "event_id": "m1"}, 0).send
    assert ack == [{"type": "session.input_audio.muted", "client_event_id": "m1"}]
    step = p.client(append, 0)
    assert step.audio is not None and len(step.audio) == 480 and not step.audio.any()
    p.client({"type": "session.input_audio.unmute"}, 0)
    assert p.client(append, 0).audio.any()  # type: ignore[union-attr]


def test_a_delegation_is_announced_and_commentary_answers_it_and_asks_for_an_answer() -> None:
    p = live()
    (created,) = p.server(call_done(), 1234).send
    assert created["type"] == "session.delegation.created" and created["offset_ms"] == 1234
    assert created["delegation"] == {
        "id": "call_1", "type": "delegation", "target": "client", "request": "the weather",
    }  # fmt: skip
    step = p.client(
        {"type": "session.commentary.append", "event_id": "e1", "delegation_id": "call_1",
         "content": "Sunny."}, 2000,
    )  # fmt: skip
    create, respond = step.handle
    assert create["item"] == {
        "type": "function_call_output",
        "call_id": "call_1",
        "output": "Sunny.",
    }
    assert respond == {"type": "response.create"}
    assert step.send[0]["type"] == "session.commentary.appended"
    assert step.send[0]["client_event_id"] == "e1" and step.send[0]["start_ms"] == 2000
    # Answered once: a second answer names no open delegation.
    with pytest.raises(LiveError) as e:
        p.client({"type": "session.thinking.append", "delegation_id": "call_1", "content": "x"}, 0)
    assert e.value.code == "unknown_delegation"


def test_thinking_answers_a_delegation_silently() -> None:
    p = live()
    p.server(call_done(), 0)
    step = p.client(
        {"type": "session.thinking.append", "delegation_id": "call_1", "content": "Sunny."}, 0
    )
    assert [h["type"] for h in step.handle] == ["conversation.item.create"]
    assert step.handle[0]["item"]["type"] == "function_call_output"


def test_responses_style_results_need_every_output_before_response_create() -> None:
    p = live()
    p.server(call_done("call_1"), 0)
    p.server(call_done("call_2"), 0)
    out = {"type": "function_call_output", "call_id": "call_1", "output": "a"}
    assert p.client({"type": "response.item.create", "item": out}, 0).handle[0]["item"] == out
    with pytest.raises(LiveError) as e:
        p.client({"type": "response.create"}, 0)
    assert e.value.code == "function_call_outputs_required" and "call_2" in str(e.value)
    p.client({"type": "response.item.create", "item": {**out, "call_id": "call_2"}}, 0)
    assert p.client({"type": "response.create"}, 0).handle == [{"type": "response.create"}]


def test_a_response_asked_for_while_one_runs_waits_for_its_end() -> None:
    p = live()
    p.server({"type": "response.created", "response": {}}, 0)
    step = p.client({"type": "session.commentary.append", "delegation_id": None,
                     "content": "Say hello."}, 0)  # fmt: skip
    assert [h["type"] for h in step.handle] == ["conversation.item.create"]
    assert step.handle[0]["item"]["role"] == "system"
    done = p.server({"type": "response.done", "response": {}}, 0)
    assert done.handle == [{"type": "response.create"}]
    assert done.send[0]["type"] == "session.usage.updated"
    # The session refusing it (its own turn began meanwhile) is no error: it waits again.
    assert p.refused(
        {"type": "response.create"},
        ProtocolError("busy", code="conversation_already_has_active_response"),
    )
    assert p.respond_later


def test_instructions_append_is_context_and_no_answer() -> None:
    step = live().client(
        {"type": "session.instructions.append", "delegation_id": None, "content": "Be formal."},
        0,
    )
    assert [h["item"]["role"] for h in step.handle] == ["system"]
    assert "Be formal." in step.handle[0]["item"]["content"][0]["text"]


@pytest.mark.parametrize(
    ("event", "code"),
    [
        ({"type": "session.start", "session": START}, "session_already_started"),
        ({"type": "session.update", "session": {"instructions": "x"}}, "invalid_value"),
        ({"type": "session.update", "session": {"delegation": {"type": "responses"}}},
         "unsupported_delegation"),
        ({"type": "response.cancel"}, "invalid_event"),  # no client event cancels a turn
        ({"type": "session.commentary.append", "delegation_id": None, "content": ""},
         "invalid_value"),
        ({"type": "response.item.create", "item": {"type": "web_search_call"}}, "invalid_value"),
    ],
)  # fmt: skip
def test_refused_client_events_name_why(event: dict[str, Any], code: str) -> None:
    with pytest.raises(LiveError) as e:
        live().client(event, 0)
    assert e.value.code == code


def test_close_drains_and_input_on_its_way_is_dropped() -> None:
    p = live()
    assert p.client({"type": "session.close"}, 0).close == "close_requested"
    append = {"type": "session.input_audio.append", "audio": ""}
    assert p.client(append, 0) == Step()
    with pytest.raises(LiveError):
        p.client({"type": "session.commentary.append", "delegation_id": None, "content": "x"}, 0)


# ---- session events ------------------------------------------------------------------------


def test_input_transcripts_carry_the_turns_span_on_the_input_timeline() -> None:
    p = live()
    p.server({"type": "input_audio_buffer.speech_started", "item_id": "u1",
              "audio_start_ms": 480}, 0)  # fmt: skip
    p.server({"type": "input_audio_buffer.speech_stopped", "item_id": "u1",
              "audio_end_ms": 2100}, 0)  # fmt: skip
    delta = {"type": "conversation.item.input_audio_transcription.delta", "item_id": "u1"}
    (ev,) = p.server({**delta, "delta": "Hello"}, 0).send
    assert ev == {"type": "session.input_transcript.delta", "delta": "Hello", "start_ms": 480,
                  "end_ms": 2100}  # fmt: skip
    done = {"type": "conversation.item.input_audio_transcription.completed", "item_id": "u1"}
    assert p.server({**done, "transcript": "Hello"}, 0).send == []  # its deltas went out
    # A transcription without deltas is sent whole.
    p.server({"type": "input_audio_buffer.speech_started", "item_id": "u2",
              "audio_start_ms": 3000}, 0)  # fmt: skip
    (ev,) = p.server({**done, "item_id": "u2", "transcript": "Bye"}, 0).send
    assert ev["delta"] == "Bye" and ev["start_ms"] == 3000


def test_output_transcripts_are_stamped_on_the_output_clock() -> None:
    p = live()
    d = {"type": "response.output_audio_transcript.delta", "item_id": "a1"}
    (first,) = p.server({**d, "delta": "It "}, 5000).send
    (second,) = p.server({**d, "delta": "is."}, 5600).send
    assert (first["start_ms"], first["end_ms"]) == (5000, 5000)
    assert (second["start_ms"], second["end_ms"]) == (5000, 5600)
    assert first["type"] == "session.output_transcript.delta"


def test_realtime_only_events_stay_inside_and_errors_are_live_errors() -> None:
    p = live()
    for kind in ("session.updated", "conversation.item.added", "response.output_item.added",
                 "output_audio_buffer.started", "input_audio_buffer.committed"):  # fmt: skip
        assert p.server({"type": kind}, 0).send == []
    err = {"type": "error", "error": {"code": "too_large", "message": "m", "param": None}}
    (ev,) = p.server(err, 0).send
    assert ev["type"] == "error" and ev["error"]["code"] == "too_large"
    assert set(ev["error"]) == {"type", "code", "message", "param", "client_event_id"}


# ---- the route ----------------------------------------------------------------------------


def test_the_websocket_starts_streams_and_closes_cleanly() -> None:
    with gateway_server(keys="sk-test") as srv:
        with srv.websocket("/v1/live/sessions", bearer("sk-test")) as ws:
            ws.send(json.dumps({"type": "session.start", "event_id": "s1", "session": START}))
            started = recv_json(ws)
            assert started["type"] == "session.started" and started["client_event_id"] == "s1"
            sid = started["session"]["id"]
            assert sid in srv.app.state.live
            with srv.websocket(f"/v1/live/sessions/{sid}/attach", bearer("sk-test")) as side:
                assert recv_json(side)["type"] == "session.updated"
                side.send(json.dumps({"type": "session.input_audio.mute", "event_id": "m"}))
                assert recv_json(side)["type"] == "session.input_audio.muted"
                # Output is a stream from the start: silence while nobody speaks.
                ev = recv_json(ws)
                assert ev["type"] == "session.output_audio.delta"
                assert not any(base64.b64decode(ev["delta"]))
                ws.send(json.dumps({"type": "session.close", "event_id": "c"}))
                seen = [recv_json(ws)["type"]]
                while seen[-1] != "session.closed":
                    seen.append(recv_json(ws)["type"])
                assert "session.usage.updated" in seen
                while (ev := recv_json(side))["type"] != "session.closed":
                    assert ev["type"] != "session.output_audio.delta"  # no audio on a sideband
                assert ev["reason"] == "close_requested" and ev["usage"]["seconds"] >= 0
        assert srv.app.state.live == {} and not srv.gw.sessions


def test_the_websocket_refuses_by_name_and_closes() -> None:
    with gateway_server() as srv:
        with srv.websocket("/v1/live/sessions") as ws:
            ws.send(json.dumps({"type": "session.input_audio.append", "audio": ""}))
            assert recv_json(ws)["error"]["code"] == "session_not_started"
        with srv.websocket("/v1/live/sessions") as ws:
            bad = {**START, "delegation": {"type": "responses", "responses": {}}}
            ws.send(json.dumps({"type": "session.start", "event_id": "s", "session": bad}))
            err = recv_json(ws)["error"]
            assert err["code"] == "unsupported_delegation" and err["client_event_id"] == "s"
            assert err["param"] == "session.delegation.type"
        assert not srv.gw.sessions


def test_a_session_start_past_max_message_bytes_is_refused_unread() -> None:
    with gateway_server(max_message_bytes=4096) as srv:
        with srv.websocket("/v1/live/sessions") as ws:
            big = {**START, "instructions": "x" * 5000}
            ws.send(json.dumps({"type": "session.start", "event_id": "s", "session": big}))
            err = recv_json(ws)["error"]
            assert err["code"] == "too_large" and "4096" in err["message"]
        assert not srv.gw.sessions


def test_a_live_event_id_past_512_characters_is_refused_and_not_echoed() -> None:
    with gateway_server() as srv:
        with srv.websocket("/v1/live/sessions") as ws:
            ws.send(json.dumps({"type": "session.start", "event_id": "s" * 513, "session": START}))
            err = recv_json(ws)["error"]
            assert err["param"] == "event_id" and err["client_event_id"] is None
        with srv.websocket("/v1/live/sessions") as ws:
            ws.send(json.dumps({"type": "session.start", "event_id": "s" * 512, "session": START}))
            assert recv_json(ws)["client_event_id"] == "s" * 512
            ws.send(json.dumps({"type": "session.input_audio.mute", "event_id": "m" * 600}))
            while (ev := recv_json(ws))["type"] != "error":
                pass
            assert ev["error"]["param"] == "event_id" and ev["error"]["client_event_id"] is None


def test_a_client_secret_starts_a_live_session_but_attaches_to_its_own_only() -> None:
    with gateway_server(keys="sk-test") as srv:
        status, body = srv.post_json(
            "/v1/realtime/client_secrets", {"session": {}}, bearer("sk-test")
        )
        assert status == 200
        secret = bearer(body["value"])
        with srv.websocket("/v1/live/sessions", bearer("sk-test")) as ws:
            ws.send(json.dumps({"type": "session.start", "session": START}))
            sid = recv_json(ws)["session"]["id"]
            assert refused(srv, f"/v1/live/sessions/{sid}/attach", secret) == 403
            assert refused(srv, "/v1/live/sessions/sess_none/attach", bearer("sk-test")) == 403
        with srv.websocket("/v1/live/sessions", secret) as ws:
            ws.send(json.dumps({"type": "session.start", "session": START}))
            assert recv_json(ws)["type"] == "session.started"


def _closed_on(side: Any) -> dict[str, Any]:
    while (ev := recv_json(side))["type"] != "session.closed":
        pass
    return ev


def test_a_close_frame_is_a_remote_hangup_and_the_hangup_route_a_close_request() -> None:
    with gateway_server(keys="sk-test") as srv:
        for how, reason in (("close frame", "remote_hangup"), ("hangup", "close_requested")):
            with srv.websocket("/v1/live/sessions", bearer("sk-test")) as ws:
                ws.send(json.dumps({"type": "session.start", "session": START}))
                sid = recv_json(ws)["session"]["id"]
                with srv.websocket(f"/v1/live/sessions/{sid}/attach", bearer("sk-test")) as side:
                    assert recv_json(side)["type"] == "session.updated"
                    if how == "hangup":
                        path = f"/v1/live/sessions/{sid}/hangup"
                        assert srv.post_json(path, {}, bearer("sk-test"))[0] == 200
                    else:
                        ws.close(1000)
                    assert _closed_on(side)["reason"] == reason, how
                if how == "hangup":
                    assert _closed_on(ws)["reason"] == "close_requested"
        path = "/v1/live/sessions/sess_none/hangup"
        assert srv.post_json(path, {}, bearer("sk-test"))[0] == 404
        assert srv.app.state.live == {} and not srv.gw.sessions


def test_a_message_over_the_limit_is_refused_on_the_connection_and_its_sideband() -> None:
    """`LiveCall.handle` holds every Live message (the WebSocket's, a sideband's, WebRTC's data
    channel's) to `max_message_bytes`."""
    with gateway_server(max_message_bytes=4096) as srv, srv.websocket("/v1/live/sessions") as ws:
        ws.send(json.dumps({"type": "session.start", "session": START}))
        sid = recv_json(ws)["session"]["id"]
        big = json.dumps({"type": "session.instructions.append", "text": "x" * 5000})
        ws.send(big)
        while (ev := recv_json(ws))["type"] != "error":
            pass
        assert ev["error"]["code"] == "too_large"
        with srv.websocket(f"/v1/live/sessions/{sid}/attach") as side:
            assert recv_json(side)["type"] == "session.updated"
            side.send(big)
            while (ev := recv_json(side))["type"] != "error":
                pass
            assert ev["error"]["code"] == "too_large"


def test_live_audio_pays_the_sessions_one_audio_credit_before_it_is_decoded() -> None:
    """`session.input_audio.append` had no credit: one 8 MiB pcmu message was ~786 s of audio
    decoded on the event loop. Now an append past the session's credit (130 s, then 4x real
    time) is refused unread, and one within it is charged once."""
    pcmu = {**START, "audio": {"format": {"type": "audio/pcmu"}}}
    with gateway_server() as srv, srv.websocket("/v1/live/sessions") as ws:
        ws.send(json.dumps({"type": "session.start", "event_id": "s", "session": pcmu}))
        assert recv_json(ws)["type"] == "session.started"
        (session,) = srv.gw.sessions
        heard, t0 = session.input.end, time.monotonic()
        big = base64.b64encode(bytes(8000 * 200)).decode()  # 200 s at 8 kHz
        ws.send(json.dumps({"type": "session.input_audio.append", "audio": big}))
        while (ev := recv_json(ws))["type"] != "error":
            pass
        assert ev["error"]["code"] == "rate_limit_exceeded", ev
        assert session.input.end == heard  # nothing of it decoded or heard
        ten = base64.b64encode(bytes(8000 * 10)).decode()
        ws.send(json.dumps({"type": "session.input_audio.append", "audio": ten}))
        ws.send(json.dumps({"type": "session.input_audio.mute", "event_id": "m"}))
        while recv_json(ws)["type"] != "session.input_audio.muted":
            pass
        assert abs(session.input.end - heard - 16000 * 10) < 1000  # heard (the resampler lags)
        # charged once (twice would leave 10 s less), whatever it regained since (4x real time)
        regained = session.audio_credit.speed * (time.monotonic() - t0)
        assert 119.99 <= session.audio_credit.credit_s <= 120 + regained  # base64 rounds up
