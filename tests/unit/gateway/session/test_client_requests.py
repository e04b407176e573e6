"""A client's requests as LiveKit's OpenAI plugin (livekit-plugins-openai 1.8) sends them on its
first turn, against a fake pipeline: each is taken, and its answer can be matched to it."""

from realtime_omni.gateway.session.driver import Session
from tests.conftest import run
from tests.unit.gateway.fakes import FakeCoord, settle


def test_livekits_first_turn_is_taken_and_its_response_carries_the_requests_metadata() -> None:
    async def body() -> None:
        coord = FakeCoord(chunks=2)
        s = Session(coord)
        await s.handle({"type": "session.update", "session": {"instructions": "Be brief."}})
        first = {"type": "message", "role": "user", "id": "item_lk1"}
        first["content"] = [{"type": "input_text", "text": "What is the weather in Paris?"}]
        create = {"type": "conversation.item.create", "item": first, "previous_item_id": "root"}
        await s.handle({**create, "event_id": "chat_ctx_create_1"})
        ask = {"instructions": None, "metadata": {"client_event_id": "response_create_1"}}
        await s.handle(
            {"type": "response.create", "event_id": "response_create_1", "response": ask}
        )
        await settle(s, lambda: s.active_response is None, read=24000)
        events = s.pending_events()
        assert [e for e in events if e["type"] == "error"] == []
        (added,) = [e for e in events if e["type"] == "conversation.item.added"][:1]
        assert added["item"]["id"] == "item_lk1" and added["previous_item_id"] is None
        for kind in ("response.created", "response.done"):
            (resp,) = [e["response"] for e in events if e["type"] == kind]
            assert resp["metadata"] == {"client_event_id": "response_create_1"}, kind
        assert coord.payloads[0]["messages"][0] == {"role": "system", "content": "Be brief."}
        # A response nobody asked for with metadata carries none.
        await s.handle({"type": "response.create"})
        await settle(s, lambda: s.active_response is None, read=24000)
        (resp,) = [e["response"] for e in s.pending_events() if e["type"] == "response.created"]
        assert resp["metadata"] is None
        await s.close()

    run(body())
