"""A response's events from its state alone: no session, no event loop, no pipeline."""

from __future__ import annotations

from realtime_omni.gateway.protocol.conversation import Item
from realtime_omni.gateway.protocol.tool_calls import Call
from realtime_omni.gateway.session.response import Response


def types(events: list[dict[str, object]]) -> list[object]:
    return [e["type"] for e in events]


def test_an_audio_answer_from_created_to_done() -> None:
    resp = Response("resp_1", Item("item_1", "assistant", status="in_progress"), {}, 0.0)
    assert types(resp.opening()) == ["response.created", "rate_limits.updated"]
    assert resp.opening()[0]["response"]["status"] == "in_progress"  # type: ignore[index]
    added = resp.item_added("item_0")
    assert types(added) == [
        "response.output_item.added",
        "conversation.item.added",
        "response.content_part.added",
    ]
    assert added[1]["previous_item_id"] == "item_0"
    assert added[2]["part"] == {"type": "audio", "transcript": ""}
    resp.count({"token_id": 1, "prefill_tokens": 10, "cached_tokens": 4})
    resp.count({"token_id": 2})
    delta = resp.text("Hello", 1.0)
    assert delta["type"] == "response.output_audio_transcript.delta" and delta["delta"] == "Hello"
    done = resp.closing("completed", None)
    assert types(done) == [
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    assert done[1]["transcript"] == "Hello" and resp.item.status == "completed"
    final = done[-1]["response"]
    assert final["status"] == "completed"  # type: ignore[index]
    usage = final["usage"]  # type: ignore[index]
    assert usage["input_tokens"] == 14 and usage["output_tokens"] == 2


def test_a_text_answer_cut_short_is_incomplete() -> None:
    resp = Response("resp_1", Item("item_1", "assistant", status="in_progress"), {}, 0.0)
    resp.text_only = True
    assert resp.item_added(None)[2]["part"] == {"type": "text", "text": ""}
    assert resp.text("Hi", 1.0)["type"] == "response.output_text.delta"
    done = resp.closing("incomplete", {"type": "incomplete", "reason": "max_output_tokens"})
    assert types(done)[0] == "response.output_text.done" and done[0]["text"] == "Hi"
    assert resp.item.status == "incomplete"
    assert done[-1]["response"]["output_modalities"] == ["text"]  # type: ignore[index]


def test_function_calls_follow_the_message_and_each_other() -> None:
    resp = Response("resp_1", Item("item_1", "assistant", status="in_progress"), {}, 0.0)
    first, after = resp.call(Call("get_weather", '{"city": "Paris"}'))
    assert after == "item_1" and first.status == "in_progress"
    events = resp.call_made(first, Call("get_weather", '{"city": "Paris"}'), "item_1")
    assert types(events) == [
        "response.output_item.added",
        "conversation.item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "conversation.item.done",
    ]
    assert events[0]["output_index"] == 1 and events[0]["item"]["status"] == "in_progress"  # type: ignore[index]
    assert events[3]["arguments"] == '{"city": "Paris"}' and first.status == "completed"
    second, after = resp.call(Call("get_time", "{}"))
    assert after == first.id
    assert resp.call_made(second, Call("get_time", "{}"), first.id)[0]["output_index"] == 2
    assert len(resp.closing("completed", None)[-1]["response"]["output"]) == 3  # type: ignore[index,arg-type]
