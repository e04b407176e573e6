"""Preemptive answers in the session, against a fake pipeline: computed at a pause, shown only
once the turn ends, aborted unseen when the person goes on."""

import asyncio

import numpy as np

from realtime_omni.gateway.protocol.conversation import Conversation
from realtime_omni.gateway.session.driver import Session
from tests.conftest import run
from tests.unit.gateway.fakes import FakeCoord, settle, silence, speak, types

RESPONSE_EVENTS = ("response.", "conversation.item.added", "output_audio_buffer.")


def shown(kinds: list[str]) -> list[str]:
    return [k for k in kinds if k.startswith(RESPONSE_EVENTS)]


def test_an_answer_the_person_talks_over_is_aborted_unseen_and_leaves_nothing() -> None:
    async def body() -> None:
        coord = FakeCoord(chunks=40, gap_s=0.001)
        s = Session(coord)
        await s.start()
        speak(s, 20)
        silence(s, 6)  # a pause mid-sentence: the answer to the first half starts, held
        await settle(s, lambda: len(coord.streams) == 1)
        (rid,) = coord.streams
        await settle(s, lambda: coord.streams[rid].taken > 2)  # it computed some audio
        await asyncio.sleep(0.02)
        assert s.responses.held is not None and s.active_response is None
        assert s.playout.queued == 0  # nothing played
        assert types(s) == ["input_audio_buffer.speech_started"]  # nothing said
        speak(s, 10)  # they go on: the held answer is abandoned
        await settle(s, lambda: coord.aborted == [rid])
        assert coord.streams[rid].closed  # its unread outputs give their credits back
        assert s.responses.held is None and s.playout.queued == 0
        assert types(s) == [] and len(s.conversation.items) == 0
        await s.close()
        assert coord.aborted == [rid]  # once

    run(body())


def test_the_released_answer_is_the_one_a_start_at_the_turns_end_would_give() -> None:
    async def body() -> None:
        coord = FakeCoord(chunks=4, gap_s=0.001)
        s = Session(coord)
        await s.start()
        speak(s, 20)
        silence(s, 5)  # speculates
        await settle(
            s, lambda: len(coord.streams) == 1 and next(iter(coord.streams.values())).taken == 4
        )
        await asyncio.sleep(0.02)  # all of it computed, and held
        assert s.active_response is None and s.playout.queued == 0
        silence(s, 11)  # the silence rule ends the turn: released at once
        kinds = types(s)
        assert kinds[:3] == [
            "input_audio_buffer.speech_started",
            "input_audio_buffer.speech_stopped",
            "input_audio_buffer.committed",
        ]
        assert "response.created" in kinds and "response.output_audio_transcript.delta" in kinds
        assert s.playout.queued > 0  # the held audio plays from the next read
        assert len(coord.payloads) == 1  # no second request
        user, answer = s.conversation.items
        assert user.role == "user" and answer.role == "assistant"
        # What a response started now would submit: the same conversation, the same audio.
        before = Conversation()
        before.add(user)
        again = before.payload(s.settings.instructions, None, None)
        held = coord.payloads[0]
        assert held["messages"] == again["messages"]
        assert np.array_equal(held["audio_0"], again["audio_0"])
        await settle(s, lambda: s.active_response is None, read=4800)
        assert types(s)[-1] == "response.done"
        await s.close()

    run(body())


def test_with_preemption_off_the_answer_starts_at_the_turns_end() -> None:
    async def body() -> None:
        coord = FakeCoord(chunks=2)
        s = Session(coord)
        td = {"type": "server_vad", "preemptive_ms": None}
        assert s.configure({"audio": {"input": {"turn_detection": td}}}) == []
        await s.start()
        speak(s, 20)
        silence(s, 15)
        await asyncio.sleep(0.02)
        assert coord.payloads == []  # nothing before the turn ends
        silence(s, 1)
        await settle(s, lambda: len(coord.payloads) == 1)
        (audio,) = [v for k, v in coord.payloads[0].items() if k.startswith("audio_")]
        assert 36 * 32 * 16 - 160 < len(audio) <= 36 * 32 * 16  # the whole turn, its silence too
        await s.close()

    run(body())


def test_prefill_while_speaking_sends_the_turn_so_far_and_nothing_to_the_client() -> None:
    async def body() -> None:
        coord = FakeCoord(chunks=0)  # a prefill-only request's stream: no output, a clean end
        s = Session(coord)
        td = {"type": "server_vad", "prefill_while_speaking": True}
        assert s.configure({"audio": {"input": {"turn_detection": td}}}) == []
        await s.start()
        silence(s, 10)
        speak(s, 20)
        await settle(s, lambda: len(coord.payloads) == 1)
        (first,) = coord.payloads
        assert first["prefill_only"] is True and first["session_id"] == s.id
        assert types(s) == ["input_audio_buffer.speech_started"]
        silence(s, 16)  # the turn ends: the answer's audio starts with the same samples
        await settle(s, lambda: len(coord.payloads) == 2)
        answer = coord.payloads[1]
        assert "prefill_only" not in answer
        head = first["audio_0"]
        assert np.array_equal(answer["audio_0"][: len(head)], head)
        await s.close()

    run(body())
