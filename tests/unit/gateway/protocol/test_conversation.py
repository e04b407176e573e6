import numpy as np
import pytest

from realtime_omni.gateway.protocol.conversation import Conversation, Item, Part, new_id


def test_payload_carries_the_conversation_with_named_arrays() -> None:
    c = Conversation()
    a0 = np.zeros(1600, np.float32)
    a1 = np.ones(1600, np.float32)
    c.add(Item("u1", "user", [Part("audio", audio=a0)]))
    bot = Item("b1", "assistant")
    bot.add_text(1.0, "Hi there.")
    c.add(bot)
    c.add(Item("u2", "user", [Part("text", text="look"), Part("audio", audio=a1)]))
    img = np.zeros((4, 4, 3), np.uint8)
    p = c.payload("be brief", image=img, temperature=0.5, max_tokens=None)
    assert p["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "audio", "audio": "audio_0"}]},
        {"role": "assistant", "content": "Hi there."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "audio", "audio": "audio_1"},
                {"type": "image", "image": "image_0"},
            ],
        },
    ]
    assert p["audio_0"] is a0 and p["audio_1"] is a1 and p["image_0"] is img
    assert p["temperature"] == 0.5 and "max_tokens" not in p


def test_payload_drops_oldest_arrays_past_the_budget() -> None:
    c = Conversation()
    for i in range(3):
        c.add(Item(f"u{i}", "user", [Part("audio", audio=np.zeros(1000, np.float32))]))
    p = c.payload(max_bytes=8500)  # room for two of the 4000-byte arrays
    assert [m["content"][0]["audio"] for m in p["messages"]] == ["audio_0", "audio_1"]
    assert p["audio_1"] is c.items[2].parts[0].audio


def test_truncate_keeps_the_text_that_was_heard() -> None:
    it = Item("b", "assistant")
    for t, s in [(1.0, "one "), (2.0, "two "), (3.0, "three")]:
        it.add_text(t, s)
    it.add_audio(160, 1.0)  # chunk from token 1 at 0 ms
    it.add_audio(160, 2.0)  # token 2 at 160 ms
    it.add_audio(160, 3.0)  # token 3 at 320 ms
    with pytest.raises(ValueError):
        it.truncate(500)
    it.truncate(200)
    assert it.transcript == "one two " and it.audio_ms == 200
    it.truncate(0)
    assert it.transcript == "" and it.audio_ms == 0


def test_insert_after_and_delete() -> None:
    c = Conversation(max_items=3)
    for i in range(3):
        c.add(Item(f"i{i}", "user", [Part("text", text=str(i))]))
    assert c.add(Item("x", "user"), previous_item_id="i0") == "i0"
    assert [i.id for i in c.items] == ["x", "i1", "i2"]  # the oldest fell off
    c.delete("x")
    with pytest.raises(KeyError):
        c.get("x")


def test_a_function_call_and_its_output_become_the_chat_templates_tool_turns() -> None:
    from realtime_omni.gateway.protocol.events import PCM16, parse_item

    c = Conversation()
    c.add(Item("u", "user", [Part("text", text="Weather in Paris?")]))
    said = Item("a", "assistant")
    said.add_text(0.0, "Let me check.")
    c.add(said)
    call = parse_item(
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        PCM16,
    )  # fmt: skip
    c.add(call)
    c.add(
        parse_item({"type": "function_call_output", "call_id": "call_1", "output": "sunny"}, PCM16)
    )
    msgs = c.payload()["messages"]
    assert msgs[1] == {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    }
    assert msgs[2] == {"role": "tool", "content": "sunny"}
    assert call.to_openai()["type"] == "function_call" and call.to_openai()["call_id"] == "call_1"


def test_tool_choice_reaches_the_thinker() -> None:
    from realtime_omni.gateway.protocol.settings import Tool
    from realtime_omni.gateway.session.responses import _tools_payload

    tools = (Tool("get_weather", "The weather", {"type": "object", "properties": {}}),)
    auto = _tools_payload(tools, "auto")
    assert [t["function"]["name"] for t in auto["tools"]] == ["get_weather"]
    assert "tool_instruction" not in auto
    assert _tools_payload(tools, "none") == {}  # no tools shown at all
    assert "calling one of" in _tools_payload(tools, "required")["tool_instruction"]
    named = _tools_payload(tools, {"type": "function", "name": "get_weather"})
    assert "get_weather" in named["tool_instruction"]


def test_text_counts_in_what_a_conversation_may_hold() -> None:
    """Before, only audio and images counted: 12 items of 7 MiB of text were all kept."""
    conv = Conversation(max_bytes=1 << 20)
    ids = []
    for _ in range(12):
        item = Item(new_id("item"), "user", [Part("text", text="x" * (300 << 10))])
        conv.add(item)
        ids.append(item.id)
    call = Item(new_id("item"), "tool", type="function_call_output", output="y" * (300 << 10))
    conv.add(call)
    assert [it.id for it in conv.items] == [*ids[-2:], call.id]  # 900 KiB: three fit
    assert conv.take_dropped() == ids[:-2]


def test_root_puts_an_item_first_as_openai_does() -> None:
    """LiveKit's plugin creates the first item of the chat context it mirrors with
    `previous_item_id: "root"`; it was refused as an unknown item."""
    c = Conversation()
    assert c.add(Item("u1", "user"), previous_item_id="root") is None
    c.add(Item("u2", "user"))
    assert c.add(Item("u0", "user"), previous_item_id="root") is None  # first, before u1
    assert [i.id for i in c.items] == ["u0", "u1", "u2"]
    with pytest.raises(KeyError):
        c.add(Item("u3", "user"), previous_item_id="nowhere")
