"""The client events' decisions with no session and no event loop: a state, an event and the
time in; the effects out, or a refusal before any."""

import base64
from dataclasses import dataclass, field

import numpy as np
import pytest

from realtime_omni.gateway.media.input_buffer import AudioCredit, InputBuffer
from realtime_omni.gateway.protocol.conversation import Conversation, Item, Part
from realtime_omni.gateway.protocol.events import ProtocolError
from realtime_omni.gateway.protocol.settings import Settings, Voices
from realtime_omni.gateway.session.client_events import (
    AddItem,
    CancelResponse,
    ClearInput,
    ClientEvents,
    CommitAudio,
    DeleteItem,
    Emit,
    Flush,
    PushAudio,
    SetSettings,
    StartResponse,
    TruncateItem,
)
from realtime_omni.gateway.session.response import Response


@dataclass
class State:
    """A session as the decisions read it."""

    id: str = "sess_1"
    voices: Voices = field(default_factory=Voices)
    conversation: Conversation = field(default_factory=Conversation)
    input: InputBuffer = field(default_factory=InputBuffer)
    aec_available: bool = False
    settings: Settings = field(default_factory=Settings)
    responding: Response | None = None
    last_response_id: str | None = None
    turn_item_id: str | None = None


def answer(state: State, audio_ms: float) -> Item:
    item = Item("item_a", "assistant")
    item.add_audio(audio_ms, None)
    state.conversation.add(item)
    return item


def test_a_refused_event_does_nothing_and_says_why() -> None:
    c, st = ClientEvents(), State()
    with pytest.raises(ProtocolError, match="unknown event type"):
        c.decide({"type": "nope"}, st, 0.0)
    with pytest.raises(ProtocolError) as e:
        c.decide({"type": "input_audio_buffer.commit"}, st, 0.0)
    assert e.value.code == "input_audio_buffer_commit_empty"
    with pytest.raises(ProtocolError) as e:
        c.decide({"type": "conversation.item.delete", "item_id": "x"}, st, 0.0)
    assert e.value.code == "item_not_found"
    with pytest.raises(ProtocolError) as e:
        c.decide({"type": "response.cancel"}, st, 0.0)
    assert e.value.code == "response_cancel_not_active"


def test_a_session_update_applies_what_parses_and_names_each_field_refused() -> None:
    st = State()
    ev = {
        "type": "session.update",
        "event_id": "e1",
        "session": {"instructions": "hi", "temperature": "hot"},
    }
    effects = ClientEvents().decide(ev, st, 0.0)
    assert isinstance(effects[0], SetSettings) and effects[0].settings.instructions == "hi"
    assert [type(e) for e in effects[1:]] == [Emit, Emit]
    err, updated = effects[1], effects[2]
    assert isinstance(err, Emit) and err.type == "error" and err.fields["error"]["event_id"] == "e1"
    assert isinstance(updated, Emit) and updated.type == "session.updated"
    assert updated.fields["session"]["instructions"] == "hi"
    assert st.settings.instructions != "hi"  # nothing was changed by deciding


def test_appends_past_the_burst_are_refused_until_the_clock_gives_credit_back() -> None:
    c = ClientEvents(AudioCredit(burst_s=2.0, speed=4.0))
    one_s = base64.b64encode(np.zeros(24000, np.int16).tobytes()).decode()  # pcm16, 24 kHz
    ev = {"type": "input_audio_buffer.append", "audio": one_s}
    assert c.decide(ev, State(), 0.0) == [PushAudio(one_s, State().settings)]
    c.decide(ev, State(), 0.0)
    with pytest.raises(ProtocolError) as e:
        c.decide(ev, State(), 0.0)
    assert e.value.code == "rate_limit_exceeded"
    assert isinstance(c.decide(ev, State(), 0.25)[0], PushAudio)  # 1 s back at 4x


def test_a_commit_takes_the_buffer_under_the_turns_item_id() -> None:
    st = State(turn_item_id="item_turn")
    st.input.push(np.ones(3200, np.float32), 16000)  # 200 ms
    clear, commit = ClientEvents().decide({"type": "input_audio_buffer.commit"}, st, 0.0)
    assert isinstance(clear, ClearInput) and isinstance(commit, CommitAudio)
    assert commit.item_id == "item_turn" and len(commit.pcm) == 3200


def test_truncating_the_answer_being_played_cancels_it_first_and_keeps_the_speech_over_it() -> None:
    st = State()
    item = answer(st, 1000)
    st.responding = Response("resp_1", item, {}, 0.0)
    ev = {"type": "conversation.item.truncate", "item_id": item.id, "audio_end_ms": 1030}
    assert ClientEvents().decide(ev, st, 0.0) == [
        CancelResponse("client_cancelled", speech_goes_on=True),
        Flush(item.id),
        TruncateItem(item.id, 1030),  # 30 ms past: within the slack, the driver keeps it all
    ]
    st.responding = None
    assert ClientEvents().decide(ev, st, 0.0) == [Flush(item.id), TruncateItem(item.id, 1030)]
    with pytest.raises(ProtocolError, match="past the item's audio"):
        ClientEvents().decide({**ev, "audio_end_ms": 1100}, st, 0.0)
    user = Item("item_u", "user", [Part("audio", audio=np.zeros(160, np.float32))])
    st.conversation.add(user)
    with pytest.raises(ProtocolError, match="only assistant items"):
        ClientEvents().decide({**ev, "item_id": "item_u"}, st, 0.0)


def test_items_and_responses() -> None:
    st = State()
    item = answer(st, 0)
    c = ClientEvents()
    add = c.decide({"type": "conversation.item.create", "item": {"x": 1}}, st, 0.0)
    assert add == [AddItem({"x": 1}, None, st.settings)]  # parsed by the driver, off the loop
    with pytest.raises(ProtocolError, match="not in the conversation"):
        c.decide({"type": "conversation.item.create", "previous_item_id": "gone"}, st, 0.0)
    ev = {"type": "conversation.item.create", "previous_item_id": "root", "item": {}}
    assert c.decide(ev, st, 0.0)[0] == AddItem({}, "root", st.settings)
    assert c.decide({"type": "conversation.item.delete", "item_id": item.id}, st, 0.0) == [
        DeleteItem(item.id)
    ]
    (start,) = c.decide({"type": "response.create", "response": {"instructions": "x"}}, st, 0.0)
    assert isinstance(start, StartResponse) and start.overrides["instructions"] == "x"
    st.responding = Response("resp_1", item, {}, 0.0)
    with pytest.raises(ProtocolError) as e:
        c.decide({"type": "response.create"}, st, 0.0)
    assert e.value.code == "conversation_already_has_active_response"
    assert c.decide({"type": "output_audio_buffer.clear"}, st, 0.0) == [
        Flush(),
        Emit("output_audio_buffer.cleared", {"response_id": "resp_1"}),
    ]
