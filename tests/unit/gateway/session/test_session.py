"""The session against a fake pipeline: turns, lead limit, barge-in, cancel, truncate."""

import asyncio
import gc
import json
import time
import weakref
from typing import Any

import numpy as np
import pytest

from realtime_omni.errors import OmniError, RequestError, StageDied
from realtime_omni.gateway.protocol.events import ProtocolError
from realtime_omni.gateway.session.driver import Session
from realtime_omni.pipeline.coordinator import Output
from tests.conftest import run
from tests.unit.gateway.fakes import (
    FakeCoord,
    FakeStream,
    UnackedCoord,
    settle,
    silence,
    speak,
    types,
)


def test_speech_turn_commits_and_streams_a_response_into_playout() -> None:
    async def body() -> None:
        coord = FakeCoord(chunks=4)
        s = Session(coord)
        await s.start()
        silence(s, 5)
        speak(s, 20)
        silence(s, 16)  # 512 ms of silence ends the turn
        ev = s.pending_events()
        kinds = [e["type"] for e in ev]
        assert kinds[:3] == [
            "input_audio_buffer.speech_started",
            "input_audio_buffer.speech_stopped",
            "input_audio_buffer.committed",
        ]
        assert "response.created" in kinds
        assert ev[1]["audio_end_ms"] == 41 * 32
        await settle(s, lambda: s.playout.queued > 0)
        await settle(s, lambda: s.active_response is None, read=4800)
        kinds = types(s)
        assert kinds[-1] == "response.done"
        assert "response.output_audio_transcript.delta" in kinds
        assert all(st.closed for st in coord.streams.values())
        (msgs,) = [p["messages"] for p in coord.payloads]
        assert msgs == [{"role": "user", "content": [{"type": "audio", "audio": "audio_0"}]}]
        audio = coord.payloads[0]["audio_0"]
        # From 0: the 300 ms prefix padding reaches the start; to the pause the answer was
        # computed at (`preemptive_ms`: 5 windows of silence), not through the 16 that ended it.
        assert len(audio) == 30 * 32 * 16
        assert s.metrics["first_audio_ms"] and s.metrics["token_to_audio_ms"]
        await s.close()

    run(body())


def test_second_turn_carries_the_conversation_so_far() -> None:
    async def body() -> None:
        coord = FakeCoord(chunks=2)
        s = Session(coord)
        await s.handle({"type": "session.update", "session": {"turn_detection": None}})
        s.push_audio(np.zeros(4800, np.float32), 24000)
        await s.handle({"type": "input_audio_buffer.commit"})
        await s.handle({"type": "response.create"})
        await settle(s, lambda: s.active_response is None, read=24000)
        await s.handle(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "and now?"}],
                },
            }
        )
        await s.handle({"type": "response.create"})
        await settle(s, lambda: s.active_response is None, read=24000)
        msgs = coord.payloads[1]["messages"]
        assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
        assert msgs[1]["content"] == "w1 "
        assert msgs[2]["content"] == [{"type": "text", "text": "and now?"}]
        # Every turn names its conversation, so the stages can continue its kept state.
        assert coord.payloads[0]["session_id"] == coord.payloads[1]["session_id"] == s.id
        await s.close()

    run(body())


def test_lead_limit_holds_the_stream_while_nobody_plays() -> None:
    async def body() -> None:
        coord = FakeCoord(chunks=40)
        s = Session(coord, max_lead_ms=1000)
        await s.handle({"type": "response.create"})
        await asyncio.sleep(0.3)
        (stream,) = coord.streams.values()
        # 320 ms per audio chunk: it stops once more than 1000 ms wait (4 chunks = 1280 ms)
        assert s.playout.queued_ms <= 1000 + 320
        assert stream.taken <= 9
        for _ in range(30):  # play 600 ms: the stream moves on
            s.read_output(480)
        await settle(s, lambda: stream.taken > 9)
        await s.close()

    run(body())


def test_barge_in_silences_the_next_read_aborts_and_keeps_what_was_played() -> None:
    async def body() -> None:
        coord = FakeCoord(chunks=40)
        s = Session(coord)
        await s.handle({"type": "response.create"})
        await settle(s, lambda: s.playout.queued > 4800)
        assert s.read_output(4800).pcm.min() == 1.0  # 200 ms heard
        rid = s.active_response
        s.pending_events()
        speak(s, 1)  # speech starts while the bot talks: paused
        assert s.read_output(480).pcm.max() == 0.0  # the very next frame is silent
        assert coord.aborted == []
        speak(s, 22)  # 736 ms of it: an interruption
        await settle(s, lambda: s.active_response is None)
        assert coord.aborted == [rid]
        assert coord.streams[rid].closed  # unread outputs give their credits back
        ev = s.pending_events()
        done = next(e for e in ev if e["type"] == "response.done")["response"]
        assert done["status"] == "cancelled"
        assert done["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
        item = s.conversation.items[-1]
        assert item.role == "assistant" and item.audio_ms == 200
        assert item.status == "incomplete"
        assert len(s.metrics["barge_in_to_silence_ms"]) == 1
        await s.close()

    run(body())


def test_audio_arriving_between_a_barge_in_and_its_cancel_is_never_played() -> None:
    """The cancel runs as a task after the barge-in: outputs the request still delivers before
    it must not reach the playout (a phone provider would be sent them after its clear)."""

    async def body() -> None:
        coord = FakeCoord(chunks=400)
        s = Session(coord)
        flushes: list[int] = []
        s.on_flush = lambda: flushes.append(s.playout.queued)
        await s.handle({"type": "response.create"})
        await settle(s, lambda: s.playout.queued > 4800)
        s.read_output(4800)
        speak(s, 23)  # an interruption (past min_interruption_ms)
        assert flushes  # the transport was told at once
        while s.active_response is not None:
            assert s.read_output(480).pcm.max() == 0.0
            await asyncio.sleep(0)
        assert s.conversation.items[-1].audio_ms == 200
        await s.close()

    run(body())


def test_a_short_sound_over_the_bot_pauses_it_and_the_answer_resumes_where_it_was() -> None:
    async def body() -> None:
        coord = FakeCoord(chunks=40)
        s = Session(coord)
        await s.handle({"type": "response.create"})
        await settle(s, lambda: s.playout.queued > 4800)
        s.read_output(4800)
        rid, played = s.active_response, s.playout.played
        before = dict(played)
        s.pending_events()
        speak(s, 6)  # "mhm": 192 ms
        assert s.read_output(480).pcm.max() == 0.0  # paused at once
        assert s.playout.played == before  # nothing was taken while paused
        silence(s, 17)  # 544 ms of silence (past resume_after_ms): it was no interruption
        assert s.read_output(480).pcm.min() == 1.0  # the answer plays on
        kinds = types(s)
        assert "input_audio_buffer.speech_started" in kinds
        assert "input_audio_buffer.cleared" in kinds  # the blip was dropped...
        assert "input_audio_buffer.committed" not in kinds  # ...not made a turn
        assert s.active_response == rid and coord.aborted == []
        assert [i.role for i in s.conversation.items] == ["assistant"]
        await s.close()

    run(body())


@pytest.mark.parametrize("then_speaks_ms", [0, 800])
def test_speech_over_an_answer_that_ends_is_still_judged(then_speaks_ms: int) -> None:
    """The answer is cancelled while a sound over it is being judged (its last echo, as the
    client cancels): a blip is dropped, not made a turn that starts a spurious answer; speech
    that goes on is the next turn."""

    async def body() -> None:
        coord = FakeCoord(chunks=400, gap_s=0.01)
        s = Session(coord)
        await s.handle({"type": "response.create"})
        await settle(s, lambda: s.playout.queued > 4800)
        speak(s, 4)  # paused over it
        await s.handle({"type": "response.cancel"})
        assert s.active_response is None
        s.pending_events()
        speak(s, then_speaks_ms // 32)
        silence(s, 20)
        kinds = types(s)
        users = [i for i in s.conversation.items if i.role == "user"]
        if then_speaks_ms:
            assert "input_audio_buffer.committed" in kinds and len(users) == 1
        else:
            assert "input_audio_buffer.cleared" in kinds
            assert "input_audio_buffer.committed" not in kinds and users == []
        await s.close()

    run(body())


def test_a_pause_the_client_stops_feeding_resumes_and_keeps_the_timeline() -> None:
    """Speech over the bot, then no more audio at all: the answer resumes after
    resume_after_ms, and the next turn is cut from the input where its speech really is."""

    async def body() -> None:
        coord = FakeCoord(chunks=400, gap_s=0.01)
        s = Session(coord)
        await s.start()
        await s.handle({"type": "response.create"})
        await settle(s, lambda: s.playout.queued > 4800)
        speak(s, 3)
        silence(s, 8)  # 256 ms of quiet, then the client sends nothing more
        assert s.read_output(480).pcm.max() == 0.0  # paused
        await asyncio.sleep(0.8)  # nothing arrives: the policy hears silence
        assert s.read_output(480).pcm.min() == 1.0  # resumed
        s.pending_events()
        silence(s, 10)
        speak(s, 25)  # 800 ms over the answer: an interruption, and the next user turn
        silence(s, 20)
        user = [i for i in s.conversation.items if i.role == "user"]
        assert len(user) == 1
        audio = user[0].parts[0].audio
        assert audio is not None and int(np.count_nonzero(audio)) == 25 * 512  # all its speech
        lead = int(np.argmax(audio != 0))  # the turn begins its prefix padding before it
        assert 268 * 16 <= lead <= 300 * 16, lead / 16
        await s.close()

    run(body())


def test_min_interruption_zero_barges_in_on_the_first_window() -> None:
    async def body() -> None:
        coord = FakeCoord(chunks=40)
        s = Session(coord)
        td = {"type": "server_vad", "min_interruption_ms": 0}
        await s.handle({"type": "session.update", "session": {"turn_detection": td}})
        await s.handle({"type": "response.create"})
        await settle(s, lambda: s.playout.queued > 4800)
        rid = s.active_response
        speak(s, 1)
        await settle(s, lambda: s.active_response is None)
        assert coord.aborted == [rid]
        await s.close()

    run(body())


def test_response_cancel_and_errors_clients_special_case() -> None:
    async def body() -> None:
        coord = FakeCoord(chunks=40, gap_s=0.01)
        s = Session(coord)
        await s.handle({"type": "response.create"})
        with pytest.raises(ProtocolError) as e:
            await s.handle({"type": "response.create"})
        assert e.value.code == "conversation_already_has_active_response"
        await settle(s, lambda: bool(coord.streams))  # submitted, outputs flowing
        await s.handle({"type": "response.cancel"})
        assert s.active_response is None and len(coord.aborted) == 1
        assert coord.streams[coord.aborted[0]].closed
        done = [e for e in s.pending_events() if e["type"] == "response.done"][-1]
        assert done["response"]["status_details"]["reason"] == "client_cancelled"
        with pytest.raises(ProtocolError) as e:
            await s.handle({"type": "response.cancel"})
        assert e.value.code == "response_cancel_not_active"
        await s.close()

    run(body())


def test_truncate_and_bad_events() -> None:
    async def body() -> None:
        s = Session(FakeCoord(chunks=4))
        await s.handle({"type": "response.create"})
        await settle(s, lambda: s.active_response is None, read=24000)
        item = s.conversation.items[-1]
        with pytest.raises(ProtocolError):  # past the audio
            await s.handle(
                {
                    "type": "conversation.item.truncate",
                    "item_id": item.id,
                    "content_index": 0,
                    "audio_end_ms": 10_000,
                }
            )
        await s.handle(
            {
                "type": "conversation.item.truncate",
                "item_id": item.id,
                "content_index": 0,
                "audio_end_ms": 300,
            }
        )
        assert item.audio_ms == 300 and item.transcript == "w1 "
        assert types(s)[-1] == "conversation.item.truncated"
        for bad in [
            {"type": "nope"},
            {"no": "type"},
            [],
            {"type": "input_audio_buffer.append", "audio": "%%%"},
            {"type": "input_audio_buffer.commit"},
            {"type": "conversation.item.create", "item": {"role": "robot"}},
        ]:
            with pytest.raises(ProtocolError):
                await s.handle(bad)
        await s.close()

    run(body())


def test_a_client_message_as_text_gives_back_the_error_to_send() -> None:
    async def body() -> None:
        s = Session(FakeCoord(chunks=1))
        assert await s.handle_text('{"type": "input_audio_buffer.clear"}', 1000) is None
        too_big = await s.handle_text(" " * 1001, 1000)
        assert too_big is not None and too_big["error"]["code"] == "message_too_large"
        not_json = await s.handle_text("{", 1000)
        assert not_json is not None and not_json["error"]["code"] == "invalid_json"
        refused = await s.handle_text('{"type": "nope", "event_id": "e7"}', 1000)
        assert refused is not None and refused["error"]["code"] == "invalid_event"
        assert refused["error"]["event_id"] == "e7"

    run(body())


def test_a_large_client_message_is_parsed_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    from realtime_omni.gateway.session import effects

    parsed_on: list[threading.Thread] = []

    def read_event(raw: str, max_bytes: int) -> Any:
        parsed_on.append(threading.current_thread())
        return json.loads(raw)

    async def body() -> None:
        monkeypatch.setattr(effects, "read_event", read_event)
        s = Session(FakeCoord(chunks=1))
        small = {"type": "input_audio_buffer.clear"}
        large = {"type": "input_audio_buffer.clear", "padding": "x" * (64 << 10)}
        assert await s.handle_text(json.dumps(small), 1 << 20) is None
        assert await s.handle_text(json.dumps(large), 1 << 20) is None
        assert parsed_on[0] is threading.main_thread()
        assert parsed_on[1] is not threading.main_thread()

    run(body())


def test_a_client_event_id_past_512_characters_is_refused_and_not_echoed() -> None:
    async def body() -> None:
        s = Session(FakeCoord(chunks=1))
        ok = {"type": "input_audio_buffer.clear", "event_id": "e" * 512}
        assert await s.handle_text(json.dumps(ok), 1 << 20) is None
        long_id = {"type": "nope", "event_id": "e" * 513}  # refused for its type as well
        err = await s.handle_text(json.dumps(long_id), 1 << 20)
        assert err is not None and err["error"]["param"] == "event_id"
        assert err["error"]["code"] == "string_above_max_length"
        assert err["error"]["event_id"] is None and len(json.dumps(err)) < 300
        not_text = await s.handle_text('{"type": "nope", "event_id": [1, 2]}', 1 << 20)
        assert not_text is not None and not_text["error"]["param"] == "event_id"
        assert not_text["error"]["event_id"] is None

    run(body())


def test_an_outgrown_conversation_is_truncated_by_its_rule_and_the_client_told() -> None:
    """Three 0.3 s turns (19,200 B of float32 each) where a turn carries 50,000 B: the third
    response deletes the oldest turn and says so; with a retention ratio of 0.5 it deletes down
    to half at once; with truncation disabled the response is refused, naming the fix."""

    async def turn(s: Session) -> list[dict[str, Any]]:
        s.push_audio(np.full(7200, 0.1, np.float32), 24000)  # 0.3 s: 4,800 samples at 16 kHz
        await s.handle({"type": "input_audio_buffer.commit"})
        refused = await s.handle_text(json.dumps({"type": "response.create"}), 1 << 20)
        await settle(s, lambda: s.active_response is None, read=24000)
        return s.pending_events() + ([refused] if refused else [])

    async def body(truncation: Any) -> tuple[Session, list[list[dict[str, Any]]]]:
        s = Session(FakeCoord(chunks=1), max_payload_bytes=50_000)
        update = {"turn_detection": None, "truncation": truncation}
        await s.handle({"type": "session.update", "session": update})
        s.pending_events()
        return s, [await turn(s) for _ in range(3)]

    async def check() -> None:
        s, turns = await body("auto")
        deleted = [e["item_id"] for e in turns[2] if e["type"] == "conversation.item.deleted"]
        assert deleted and all(not any(e["type"] == "conversation.item.deleted" for e in t)
                               for t in turns[:2])  # fmt: skip
        assert deleted[0] not in [it.id for it in s.conversation.items]
        assert s.conversation.array_bytes() <= 50_000
        await s.close()
        s, turns = await body({"type": "retention_ratio", "retention_ratio": 0.5})
        assert s.conversation.array_bytes() <= 25_000
        await s.close()
        s, turns = await body("disabled")
        errors = [e for e in turns[2] if e["type"] == "error"]
        assert errors and errors[0]["error"]["code"] == "context_length_exceeded"
        assert "truncation" in errors[0]["error"]["message"]
        await s.close()

    run(check())


def test_deeply_nested_json_is_an_error_event_not_a_crash() -> None:
    async def body() -> None:
        s = Session(FakeCoord(chunks=1))
        err = await s.handle_text("[" * 200_000 + "]" * 200_000, 1 << 20)
        assert err is not None and err["error"]["code"] == "invalid_json"
        await s.close()

    run(body())


def test_an_event_that_fails_on_a_bug_tells_the_client_so_without_pythons_words(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from realtime_omni.gateway.session import client_events

    def broken(*args: Any) -> list[Any]:
        raise KeyError("the server's own internals")

    monkeypatch.setitem(client_events._DECISIONS, "input_audio_buffer.clear", broken)

    async def body() -> None:
        s = Session(FakeCoord(chunks=1))
        err = await s.handle_text('{"type": "input_audio_buffer.clear", "event_id": "e7"}', 1 << 20)
        assert err is not None and err["error"]["type"] == "server_error"
        assert err["error"]["event_id"] == "e7" and "internals" not in json.dumps(err)
        await s.close()

    run(body())


def test_audio_appended_faster_than_real_time_past_a_burst_is_refused_not_queued() -> None:
    import base64

    from realtime_omni.gateway.media.input_buffer import AudioCredit

    one_s = base64.b64encode(np.zeros(24000, np.int16).tobytes()).decode()  # pcm16, 24 kHz
    append = json.dumps({"type": "input_audio_buffer.append", "audio": one_s})

    async def body() -> None:
        s = Session(FakeCoord(chunks=1))
        s.client.credit = AudioCredit(burst_s=2.0, speed=4.0)
        assert await s.handle_text(append, 1 << 20) is None
        assert await s.handle_text(append, 1 << 20) is None
        held = s.input.end
        err = await s.handle_text(append, 1 << 20)
        assert err is not None and err["error"]["code"] == "rate_limit_exceeded"
        assert "4x real time" in err["error"]["message"] and s.input.end == held  # not queued
        await asyncio.sleep(0.3)  # 1.2 s of audio's credit
        assert await s.handle_text(append, 1 << 20) is None and s.input.end > held
        await s.close()

    run(body())


def test_every_transports_audio_pays_one_credit_and_an_append_pays_once() -> None:
    """`push_audio` (phone media, SIP, WebRTC and its concealment of gaps) had no credit: a
    phone stream's 1 MiB message was 98 s heard at once. Now it charges the session's one
    audio credit, shared with `input_audio_buffer.append`, which pays before decoding."""
    import base64

    async def body() -> None:
        s = Session(FakeCoord(chunks=1))
        credit = s.audio_credit
        assert s.client.credit is credit  # one credit for every way in
        burst, t0 = credit.credit_s, time.monotonic()

        def refilled() -> float:  # what the credit may have regained since t0: 4x real time
            return credit.speed * (time.monotonic() - t0)

        assert s.push_audio(np.zeros(8000 * 100, np.int16), 8000)  # 100 s: within the burst
        assert not s.push_audio(np.zeros(8000 * 60, np.int16), 8000)  # past it: dropped
        assert s.audio_dropped_s == 60.0
        assert burst - 100 <= credit.credit_s <= burst - 100 + refilled()
        ten_s = base64.b64encode(np.zeros(240000, np.int16).tobytes()).decode()
        append = json.dumps({"type": "input_audio_buffer.append", "audio": ten_s})
        assert await s.handle_text(append, 1 << 22) is None
        # charged once (twice would leave 10 s less), whatever the time since refilled
        assert burst - 110 <= credit.credit_s <= burst - 110 + refilled()
        await s.close()

    run(body())


class BadStream(FakeStream):
    """An output the session's own handling breaks on (not an OmniError)."""

    async def __anext__(self) -> Output:
        if self.taken:
            raise StopAsyncIteration
        self.taken = 1
        return Output("code2wav", {"pcm": "not audio", "token_time": time.monotonic()})


class BadOutputCoord(FakeCoord):
    async def submit(self, payload: dict[str, Any], request_id: str | None = None) -> FakeStream:
        stream = await super().submit(payload, request_id)
        if len(self.payloads) == 1:  # the first response only
            assert request_id is not None
            self.streams[request_id] = stream = BadStream(self.chunks, self.gap_s)
        return stream


class RefusingStream(FakeStream):
    """A request a stage refused, as the coordinator's stream says it."""

    async def __anext__(self) -> Output:
        raise RequestError(
            "stage thinker: thinker: KV cache full (4 of 4 blocks of 16 tokens held by running "
            "requests); raise the stage's kv_cache_tokens or kv_cache_gib, or lower max_batch"
        )


class RefusingCoord(FakeCoord):
    async def submit(self, payload: dict[str, Any], request_id: str | None = None) -> FakeStream:
        await super().submit(payload, request_id)
        return RefusingStream(self.chunks, self.gap_s)


def test_a_request_a_stage_refused_fails_its_response_with_the_cause() -> None:
    async def body() -> None:
        s = Session(RefusingCoord(chunks=2))
        await s.handle({"type": "session.update", "session": {"turn_detection": None}})
        await s.handle({"type": "response.create"})
        await settle(s, lambda: s.active_response is None)
        done = [e for e in s.pending_events() if e["type"] == "response.done"]
        assert done[-1]["response"]["status"] == "failed"
        error = done[-1]["response"]["status_details"]["error"]
        assert error["type"] == "server_error" and "KV cache full" in error["message"]
        await s.close()

    run(body())


class LateCoord(FakeCoord):
    """A pipeline past a request's deadline (runtime.first_output_timeout_s), as the
    coordinator says it: at `submit` (no stage up to take it) or on the stream (no output)."""

    def __init__(self, at_submit: bool) -> None:
        super().__init__(chunks=2)
        self.at_submit = at_submit

    async def submit(self, payload: dict[str, Any], request_id: str | None = None) -> FakeStream:
        if self.at_submit:
            raise StageDied(
                "stage processes ['thinker#0'] are down and were not back within 30 s "
                "(runtime.first_output_timeout_s)"
            )
        await super().submit(payload, request_id)
        return LateStream(self.chunks, self.gap_s)


class LateStream(FakeStream):
    async def __anext__(self) -> Output:
        raise RequestError("no output within 30 s (runtime.first_output_timeout_s)")


@pytest.mark.parametrize("at_submit", [True, False])
def test_a_request_past_its_deadline_tells_the_call_why_and_the_next_one_runs(
    at_submit: bool,
) -> None:
    async def body() -> None:
        coord = LateCoord(at_submit)
        s = Session(coord)
        await s.handle({"type": "session.update", "session": {"turn_detection": None}})
        await s.handle({"type": "response.create"})
        await settle(s, lambda: s.active_response is None)
        events = s.pending_events()
        kinds = [e["type"] for e in events]
        assert kinds[-1] == "response.done" and "error" in kinds
        error = events[kinds.index("error")]["error"]
        assert error["type"] == "server_error" and "within 30 s" in error["message"]
        done = events[-1]["response"]
        assert done["status"] == "failed"
        assert done["status_details"]["error"]["message"] == error["message"]
        coord.at_submit = False  # the session takes the next response
        await s.handle({"type": "response.create"})
        await settle(s, lambda: s.active_response is None)
        assert types(s).count("response.done") == 1
        await s.close()

    run(body())


def test_a_response_that_fails_on_a_bug_ends_and_the_next_one_runs() -> None:
    async def body() -> None:
        coord = BadOutputCoord(chunks=2)
        s = Session(coord)
        await s.handle({"type": "session.update", "session": {"turn_detection": None}})
        await s.handle({"type": "response.create"})
        await settle(s, lambda: s.active_response is None)
        done = [e for e in s.pending_events() if e["type"] == "response.done"]
        assert done[-1]["response"]["status"] == "failed"
        error = done[-1]["response"]["status_details"]["error"]  # Python's words stay in the log
        assert error == {"type": "server_error", "message": "the server failed; it logged why"}
        await s.handle({"type": "response.create"})  # refused while the first stayed active
        await settle(s, lambda: s.active_response is None, read=24000)
        done = [e for e in s.pending_events() if e["type"] == "response.done"]
        assert done[-1]["response"]["status"] == "completed"
        await s.close()

    run(body())


def test_a_session_keeps_at_most_its_bytes_and_says_what_it_dropped() -> None:
    """Before, only 256 items bounded a session: about 2 GB of float32 audio."""

    async def body() -> None:
        s = Session(FakeCoord(chunks=1), max_session_bytes=50_000)
        await s.handle({"type": "session.update", "session": {"turn_detection": None}})
        events = []
        for _ in range(4):
            s.push_audio(np.full(7200, 0.1, np.float32), 24000)  # 19,200 B at 16 kHz
            await s.handle({"type": "input_audio_buffer.commit"})
            events += s.pending_events()
        ids = [e["item_id"] for e in events if e["type"] == "input_audio_buffer.committed"]
        deleted = [e["item_id"] for e in events if e["type"] == "conversation.item.deleted"]
        assert s.conversation.array_bytes() <= 50_000
        assert [it.id for it in s.conversation.items] == ids[2:] and deleted == ids[:2]
        await s.close()

    run(body())


class TokenStream(FakeStream):
    """The thinker's tokens through decode, as the real pipeline sends them: the first one
    says how long the prompt was."""

    async def __anext__(self) -> Output:
        if self.taken >= self.chunks:
            raise StopAsyncIteration
        self.taken += 1
        data = {"text": f"t{self.taken} ", "token_id": self.taken, "index": self.taken - 1}
        if self.taken == 1:
            data.update(prefill_tokens=17, cached_tokens=5)
        return Output("decode", {**data, "token_time": time.monotonic()})


class TokenCoord(FakeCoord):
    async def submit(self, payload: dict[str, Any], request_id: str | None = None) -> FakeStream:
        assert request_id is not None
        self.payloads.append(payload)
        self.streams[request_id] = s = TokenStream(self.chunks, 0.0)
        return s


@pytest.mark.parametrize(("max_tokens", "status"), [(3, "incomplete"), (10, "completed")])
def test_response_done_has_usage_and_says_when_max_output_tokens_cut_it(
    max_tokens: int, status: str
) -> None:
    async def body() -> None:
        s = Session(TokenCoord(chunks=3))
        await s.handle({"type": "session.update", "session": {"max_output_tokens": max_tokens}})
        await s.handle({"type": "response.create"})
        await settle(s, lambda: s.active_response is None)
        (done,) = [e for e in s.pending_events() if e["type"] == "response.done"]
        r = done["response"]
        assert r["status"] == status
        if status == "incomplete":
            assert r["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
        u = r["usage"]
        # the whole prompt (17 prefilled + 5 the cache held), of which 5 cached, as OpenAI's
        assert u["input_tokens"] == 22 and u["input_token_details"]["cached_tokens"] == 5
        assert u["output_token_details"]["text_tokens"] == 3
        assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
        await s.close()

    run(body())


def test_a_barge_in_says_the_output_buffer_was_cleared_and_a_late_truncate_is_kept() -> None:
    async def body() -> None:
        coord = FakeCoord(chunks=400)
        s = Session(coord)
        await s.handle({"type": "response.create"})
        await settle(s, lambda: s.playout.queued > 4800)
        rid = s.active_response
        s.read_output(4800)  # 200 ms heard
        speak(s, 23)  # an interruption
        await settle(s, lambda: s.active_response is None)
        ev = s.pending_events()
        cleared = [e for e in ev if e["type"] == "output_audio_buffer.cleared"]
        assert [e["response_id"] for e in cleared] == [rid]
        item = s.conversation.items[-1]
        assert item.audio_ms == 200
        # a client's rounded-up playback position: kept whole, not refused
        await s.handle(
            {"type": "conversation.item.truncate", "item_id": item.id, "audio_end_ms": 201}
        )
        (t,) = [e for e in s.pending_events() if e["type"] == "conversation.item.truncated"]
        assert t["audio_end_ms"] == 200
        with pytest.raises(ProtocolError):  # well past it is still a mistake
            await s.handle(
                {"type": "conversation.item.truncate", "item_id": item.id, "audio_end_ms": 900}
            )
        await s.close()

    run(body())


def test_user_audio_is_transcribed_after_its_answer_starts_speaking() -> None:
    async def body() -> None:
        coord = FakeCoord(chunks=6, gap_s=0.01)
        s = Session(coord)
        td = {"audio": {"input": {"transcription": {"model": "whisper-1", "language": "en"}}}}
        await s.handle({"type": "session.update", "session": {"turn_detection": None, **td}})
        s.push_audio(np.full(4800, 0.1, np.float32), 24000)
        await s.handle({"type": "input_audio_buffer.commit"})
        await s.handle({"type": "response.create"})
        await settle(s, lambda: len(coord.payloads) == 2, read=480)
        answer, tr = coord.payloads
        assert "text_only" not in answer and tr["text_only"] is True
        assert "Transcribe" in tr["messages"][0]["content"] and "en" in tr["messages"][0]["content"]
        user = s.conversation.items[0]
        assert np.array_equal(tr["audio_0"], user.parts[0].audio)  # the item's own audio
        await settle(s, lambda: user.parts[0].text != "", read=480)
        events = s.pending_events()
        deltas = [e for e in events if e["type"].endswith("input_audio_transcription.delta")]
        (done,) = [e for e in events if e["type"].endswith("input_audio_transcription.completed")]
        assert deltas and done["item_id"] == user.id and done["transcript"] == user.parts[0].text
        assert done["usage"]["type"] == "tokens"
        assert user.to_openai()["content"][0]["transcript"] == done["transcript"]
        await s.close()

    run(body())


def test_a_client_truncating_the_answer_under_speech_makes_that_speech_the_next_turn() -> None:
    """OpenAI's clients cut the answer at speech_started: that speech is an interruption by
    their judgement, a turn even if it pauses like a backchannel."""

    async def body() -> None:
        coord = FakeCoord(chunks=400, gap_s=0.01)
        s = Session(coord)
        await s.handle({"type": "response.create"})
        await settle(s, lambda: s.playout.queued > 4800)
        s.read_output(4800)
        item_id = s.conversation.items[-1].id
        speak(s, 6)  # paused over the answer
        await s.handle(
            {"type": "conversation.item.truncate", "item_id": item_id, "audio_end_ms": 100}
        )
        assert not s.playout.paused and s.active_response is None
        silence(s, 20)  # a pause that would have made it a blip
        assert "input_audio_buffer.committed" in types(s)
        await s.close()

    run(body())


def test_idle_timeout_asks_for_an_answer_after_the_last_one_was_heard() -> None:
    from dataclasses import replace

    async def body() -> None:
        coord = FakeCoord(chunks=2)
        s = Session(coord)
        td = s.settings.turn_detection
        assert td is not None
        # 50 ms instead of session.update's 5..30 s, to keep the test short
        s.settings = replace(s.settings, turn_detection=replace(td, idle_timeout_ms=50))
        await s.handle({"type": "response.create"})
        await settle(s, lambda: s.active_response is None, read=4800)
        first = s.active_response
        s.pending_events()
        silence(s, 2)
        await settle(s, lambda: s.active_response is not None or len(coord.payloads) > 1)
        kinds = types(s)
        assert kinds[0] == "input_audio_buffer.timeout_triggered", kinds
        assert "response.created" in kinds and first is None
        await settle(s, lambda: s.active_response is None, read=4800)
        s.pending_events()
        speak(s, 3)  # speech disarms it: no answer starts on its own
        await asyncio.sleep(0.15)
        assert "input_audio_buffer.timeout_triggered" not in types(s)
        await s.close()

    run(body())


def test_the_echo_gate_listens_through_a_canceller_only_when_asked() -> None:
    pytest.importorskip("livekit")

    async def body() -> None:
        s = Session(FakeCoord())
        await s.start()
        assert s.echo.gate_aec is None  # off by default: it damps a headset's early interruption
        td = {"type": "server_vad", "echo_gate_aec": True}
        assert s.configure({"audio": {"input": {"turn_detection": td}}}) == []
        assert s.echo.gate_aec is not None
        assert s.settings.to_openai(s.id)["audio"]["input"]["turn_detection"]["echo_gate_aec"]
        s.push_audio(np.zeros(1000, np.float32), 16000)
        (chunk,) = s.hearing._pending
        assert chunk.shape == (2, 960)  # whole 10 ms frames, beside what the canceller left
        await s.close()

    run(body(), 10)


@pytest.mark.parametrize("pad", [True, False])
def test_the_echo_gate_hears_what_is_read_out_and_no_padding(pad: bool) -> None:
    """Every read with audio reaches the gate at 16 kHz; the read after the audio hands over
    the resampler's tail, and reads of padding alone (or nothing, without `pad`: the
    WebSocket, phone and SIP transports) reach it no more."""

    async def main() -> None:
        s = Session(FakeCoord(), output_rate_hz=24000)
        heard: list[int] = []
        far = s.turns.gate.far
        s.turns.gate.far = lambda pcm, t: heard.append(len(pcm)) or far(pcm, t)  # type: ignore[method-assign]
        for _ in range(3):
            s.read_output(480, pad)  # nothing playing
        assert heard == []
        t = np.arange(480 * 5) / 24000
        s.playout.write("item", (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32))
        for _ in range(5 + 10):
            s.read_output(480, pad)
        assert len(heard) == 6  # five reads of the tone and one tail
        assert abs(sum(heard) - 5 * 320) <= 2  # all of it, at 16 kHz
        assert s.turns.gate._slots  # the gate keeps the energies it was told

    run(asyncio.wait_for(main(), 10))


class ForgetfulCoord(FakeCoord):
    """Keeps no payload: what holds a request's audio is the session alone."""

    async def submit(self, payload: dict[str, Any], request_id: str | None = None) -> FakeStream:
        stream = await super().submit(payload, request_id)
        self.payloads.clear()
        return stream


@pytest.mark.parametrize("how", ["deleted", "dropped"])
def test_an_item_that_leaves_the_conversation_stops_its_transcription_and_its_audio(
    how: str,
) -> None:
    """Before, each committed turn's transcription (one at a time, behind the answer) held its
    item's audio until it ran, after the client deleted the item or the session's bound dropped
    it: the audio a session held was past `max_session_bytes`."""

    async def body() -> None:
        coord = ForgetfulCoord(chunks=100_000, gap_s=0.05)  # a transcription that never ends
        s = Session(coord, max_session_bytes=100_000)
        td = {"audio": {"input": {"transcription": {"model": "whisper-1"}}}}
        await s.handle({"type": "session.update", "session": {"turn_detection": None, **td}})
        audio: list[weakref.ref[np.ndarray]] = []
        for _ in range(3):  # 25,600 B each at 16 kHz: all three fit
            s.push_audio(np.full(9600, 0.1, np.float32), 24000)
            await s.handle({"type": "input_audio_buffer.commit"})
            audio.append(weakref.ref(s.conversation.items[-1].parts[0].audio))  # type: ignore[arg-type]
        first, *queued = [it.id for it in s.conversation.items]
        await settle(s, lambda: len(coord.streams) == 1)  # the first runs, two wait their turn
        rid = next(iter(coord.streams))
        if how == "deleted":
            for item_id in [first, *queued]:
                await s.handle({"type": "conversation.item.delete", "item_id": item_id})
        else:  # three more items push the first three out of the session's 100,000 B
            for _ in range(3):
                s.push_audio(np.full(9600, 0.1, np.float32), 24000)
                await s.handle({"type": "input_audio_buffer.commit"})
        deleted = [e["item_id"] for e in s.pending_events() if e["type"].endswith("item.deleted")]
        assert deleted == [first, *queued]
        await settle(s, lambda: rid in coord.aborted)  # the running one stopped in the stages
        assert coord.streams[rid].closed

        def released() -> bool:
            gc.collect()
            return all(a() is None for a in audio)

        await settle(s, released)
        assert len(coord.streams) == (1 if how == "deleted" else 2)  # none ran for a gone item
        await s.close()

    run(body())


def test_an_abort_no_stage_acknowledges_still_ends_the_response_and_the_next_turn_is_answered() -> (
    None
):
    async def body() -> None:
        coord = UnackedCoord(chunks=40)
        s = Session(coord)
        await s.handle({"type": "response.create"})
        await settle(s, lambda: s.playout.queued > 4800)
        s.read_output(4800)
        rid = s.active_response
        speak(s, 23)  # an interruption: the barge-in's abort times out
        await settle(s, lambda: s.active_response is None)
        assert coord.aborted == [rid]
        done = next(e for e in s.pending_events() if e["type"] == "response.done")["response"]
        assert done["status"] == "cancelled"
        assert s.playout.queued == 0 and s.conversation.items[-1].audio_ms == 200
        await s.handle({"type": "response.create"})  # the session goes on
        await settle(s, lambda: s.playout.queued > 0)
        with pytest.raises(OmniError, match="not acknowledged"):  # a client's cancel is told
            await s.cancel_response("client_cancelled")
        assert s.active_response is None
        await s.close()

    run(body())
