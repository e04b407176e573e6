"""Transcription sessions (`/v1/realtime?intent=transcription`): the session object, what a
transcription session refuses, and that its turns are transcribed and never answered."""

import numpy as np
import pytest

from realtime_omni.gateway.protocol.events import ProtocolError
from realtime_omni.gateway.protocol.session_update import apply_session_update
from realtime_omni.gateway.protocol.settings import Settings, TurnDetection, new_settings
from realtime_omni.gateway.session.client_events import ANSWER_EVENTS, ClientEvents
from realtime_omni.gateway.session.driver import Session
from tests.conftest import run
from tests.e2e.shapes import check
from tests.unit.gateway.fakes import FakeCoord, settle, silence, speak
from tests.unit.gateway.session.test_client_events import State


def transcription_session(coord: FakeCoord) -> Session:
    s = Session(coord)
    assert s.configure({"type": "transcription"}) == []
    return s


def test_a_transcription_session_can_never_answer_whatever_its_turn_detection_says() -> None:
    s = new_settings("transcription")
    assert s.transcription is not None  # it transcribes from the start
    td = s.turn_detection
    assert td is not None and td == TurnDetection().without_answers()
    assert not td.create_response and not td.interrupt_response and td.idle_timeout_ms is None
    assert td.turns.preemptive_ms is None and not td.turns.prefill_while_speaking
    answering = TurnDetection(create_response=True, idle_timeout_ms=6000)
    assert Settings(type="transcription", turn_detection=answering).turn_detection == td
    # One that asks for answers is told no, field by field; what parsed is applied.
    update = {
        "type": "transcription",
        "audio": {
            "input": {
                "turn_detection": {
                    "type": "server_vad",
                    "silence_duration_ms": 700,
                    "create_response": True,
                    "preemptive_ms": 160,
                    "prefill_while_speaking": True,
                }
            }
        },
    }
    out, refused = apply_session_update(s, update)
    assert sorted(e.param or "" for e in refused) == [
        f"session.audio.input.turn_detection.{k}"
        for k in ("create_response", "preemptive_ms", "prefill_while_speaking")
    ]
    assert {e.code for e in refused} == {"unsupported_value"}
    assert out.turn_detection is not None and out.turn_detection.vad.silence_duration_ms == 700
    assert out.turn_detection == out.turn_detection.without_answers()


def test_the_transcription_session_object_is_openais() -> None:
    s = new_settings("transcription")
    shown = s.to_openai("sess_1")
    assert shown["type"] == "transcription"
    assert shown["object"] == "realtime.transcription_session"
    assert set(shown["audio"]) == {"input"}
    td = shown["audio"]["input"]["turn_detection"]
    assert td["type"] == "server_vad" and td["create_response"] is False
    assert "preemptive_ms" not in td  # no answers: the answering extensions are not shown
    for kind in ("session.created", "session.updated"):
        ev = {"type": kind, "event_id": "event_1", "session": shown}
        assert check(ev) == []
        ev = {"type": kind, "event_id": "event_1", "session": s.to_openai("sess_1", beta=True)}
        assert check(ev, beta=True) == []


def test_an_update_for_the_other_session_type_is_refused_whole() -> None:
    realtime, tr = Settings(), new_settings("transcription")
    with pytest.raises(ProtocolError) as e:  # OpenAI's words, code and param
        apply_session_update(realtime, {"type": "transcription", "instructions": "x"})
    assert e.value.code == "invalid_parameter" and e.value.param == "session.type"
    assert "transcription session update event to a realtime session" in str(e.value)
    with pytest.raises(ProtocolError) as e:
        apply_session_update(tr, {"type": "realtime", "instructions": "x"})
    assert e.value.code == "invalid_parameter"


def test_a_transcription_session_refuses_a_realtime_sessions_fields_by_name() -> None:
    update = {
        "type": "transcription",
        "instructions": "be brief",
        "tools": [],
        "audio": {
            "input": {"transcription": {"model": "qwen3-omni", "language": "de"}},
            "output": {"voice": "ash"},
        },
    }
    out, refused = apply_session_update(new_settings("transcription"), update)
    assert sorted((e.param, e.code) for e in refused) == [
        ("session.audio.output", "unknown_parameter"),
        ("session.instructions", "unknown_parameter"),
        ("session.tools", "unknown_parameter"),
    ]
    assert out.transcription is not None and out.transcription.language == "de"
    assert out.instructions == "" and out.voice is None  # nothing of a realtime session's
    # The type may be left out of an update; it is the session's own.
    out, refused = apply_session_update(out, {"audio": {"input": {"transcription": None}}})
    assert refused == [] and out.transcription is None and out.type == "transcription"


@pytest.mark.parametrize("kind", sorted(ANSWER_EVENTS))
def test_a_transcription_session_refuses_every_event_that_makes_or_cuts_an_answer(
    kind: str,
) -> None:
    st = State(settings=new_settings("transcription"))
    with pytest.raises(ProtocolError) as e:
        ClientEvents().decide({"type": kind, "item_id": "x", "audio_end_ms": 0}, st, 0.0)
    assert (e.value.code, e.value.param) == ("invalid_value", "type")
    assert "transcription session" in str(e.value)


def test_a_client_secrets_transcription_type_makes_the_session_one() -> None:
    s = Session(FakeCoord())
    refused = s.configure(
        {"type": "transcription", "audio": {"input": {"transcription": {"language": "fr"}}}}
    )
    assert refused == [] and s.settings.type == "transcription"
    assert s.settings.transcription is not None and s.settings.transcription.language == "fr"


def test_turns_are_transcribed_text_only_and_never_answered() -> None:
    async def body() -> None:
        coord = FakeCoord(chunks=6)
        s = transcription_session(coord)
        await s.start()
        for _ in range(2):
            silence(s, 5)
            speak(s, 10)
            silence(s, 5)  # a pause a preemptive answer would start at (160 ms)
            speak(s, 10)
            silence(s, 16)  # 512 ms: the turn ends
        await settle(s, lambda: len(s.transcriptions._tasks) == 0 and len(coord.payloads) == 2)
        events = s.pending_events()
        kinds = [e["type"] for e in events]
        assert not [k for k in kinds if k.startswith(("response.", "output_audio_buffer."))]
        assert kinds.count("input_audio_buffer.committed") == 2
        assert all(p["text_only"] is True for p in coord.payloads)  # no talker, no code2wav
        assert all("Transcribe" in p["messages"][0]["content"] for p in coord.payloads)
        items = [e["item_id"] for e in events if e["type"] == "input_audio_buffer.committed"]
        for item_id in items:
            mine = [e for e in events if e.get("item_id") == item_id]
            deltas = [e["delta"] for e in mine if e["type"].endswith("transcription.delta")]
            (done,) = [e for e in mine if e["type"].endswith("transcription.completed")]
            assert deltas and "".join(deltas).strip() == done["transcript"]
            assert [e["type"] for e in mine].index("input_audio_buffer.committed") < [
                e["type"] for e in mine
            ].index("conversation.item.input_audio_transcription.completed")
        with pytest.raises(ProtocolError):
            await s.handle({"type": "response.create"})
        assert len(coord.payloads) == 2
        await s.close()

    run(body())


def test_a_transcription_session_with_manual_commits_transcribes_each_commit() -> None:
    async def body() -> None:
        coord = FakeCoord(chunks=2)
        s = transcription_session(coord)
        update = {"type": "transcription", "audio": {"input": {"turn_detection": None}}}
        await s.handle({"type": "session.update", "session": update})
        (shown,) = [e for e in s.pending_events() if e["type"] == "session.updated"]
        assert shown["session"]["type"] == "transcription"
        assert shown["session"]["audio"]["input"]["turn_detection"] is None
        s.push_audio(np.full(4800, 0.1, np.float32), 24000)
        await s.handle({"type": "input_audio_buffer.commit"})
        await settle(s, lambda: s.conversation.items[0].parts[0].text != "")
        assert [p["text_only"] for p in coord.payloads] == [True]
        await s.close()

    run(body())
