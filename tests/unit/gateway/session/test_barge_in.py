"""A barge-in against a fake pipeline: the answer it cuts ends truncated at what was heard,
whether its request still ran or had ended with its audio still playing (issue 39)."""

import pytest

from realtime_omni.gateway.session.driver import Session
from tests.conftest import run
from tests.unit.gateway.fakes import FakeCoord, settle, speak


@pytest.mark.parametrize("generation", ["running", "ended"])
def test_a_barge_in_truncates_the_answer_at_what_was_heard_with_one_flush(generation: str) -> None:
    """Running: 40 outputs, held by the lead limit. Ended: 4 outputs (640 ms of audio), all
    taken, the response waiting for its audio to be read out. Either way the person heard
    200 ms and the conversation must keep that much, words included, not the whole answer."""

    async def body() -> None:
        coord = FakeCoord(chunks=40 if generation == "running" else 4)
        s = Session(coord)
        flushes: list[int] = []
        s.on_flush = lambda: flushes.append(s.playout.queued)
        await s.handle({"type": "response.create"})
        rid = s.active_response
        assert rid is not None
        if generation == "ended":
            await settle(s, lambda: rid in coord.streams and coord.streams[rid].closed)  # all taken
        else:
            await settle(s, lambda: s.playout.queued > 4800)
        assert s.playout.queued > 4800  # more than what will be heard is queued
        s.read_output(4800)  # 200 ms heard
        item = s.conversation.items[-1]
        assert item.transcript.startswith("w1 w3 ")  # words made past what will be heard
        s.pending_events()
        speak(s, 23)  # an interruption (past min_interruption_ms)
        assert s.read_output(480).pcm.max() == 0.0  # silent at once
        await settle(s, lambda: s.active_response is None)
        ev = s.pending_events()
        kinds = [e["type"] for e in ev]
        done = next(e for e in ev if e["type"] == "response.done")["response"]
        assert done["status"] == "cancelled", done["status"]
        assert done["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
        # The conversation keeps what was heard: 200 ms, and the words said by then.
        assert item.audio_ms == 200 and item.transcript == "w1 "
        assert done["output"][0]["content"][0]["transcript"] == "w1 "
        assert coord.aborted == [rid]
        assert len(flushes) == 1, flushes  # the transport drops its own buffer once
        # ... and the client is told so, as OpenAI tells it on WebRTC, before response.done.
        (truncated,) = [e for e in ev if e["type"] == "conversation.item.truncated"]
        assert truncated == {
            "type": "conversation.item.truncated",
            "item_id": item.id,
            "content_index": 0,
            "audio_end_ms": 200,
        }
        order = ["output_audio_buffer.cleared", "conversation.item.truncated", "response.done"]
        assert [k for k in kinds if k in order] == order
        assert len(s.metrics["barge_in_to_silence_ms"]) == 1  # timed once, at its pause
        await s.close()

    run(body())
