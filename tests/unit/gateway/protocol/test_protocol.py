import json

import pytest

from realtime_omni.gateway.protocol import events
from realtime_omni.gateway.protocol.events import (
    MAX_JSON_NODES,
    PCM16,
    ProtocolError,
    error_event,
    for_beta,
    json_values_at_most,
    loads,
    parse_item,
)
from realtime_omni.gateway.protocol.session_update import apply_session_update as apply_with_errors
from realtime_omni.gateway.protocol.settings import Settings, Voices


def apply_session_update(s: Settings, session: object) -> Settings:
    """The update, or its first refusal raised."""
    out, refused = apply_with_errors(s, session)
    if refused:
        raise refused[0]
    return out


def test_ga_session_update() -> None:
    s = apply_session_update(
        Settings(),
        {
            "type": "realtime",
            "instructions": "hi",
            "audio": {
                "input": {"format": {"type": "audio/pcmu"}, "turn_detection": None},
                "output": {"format": {"type": "audio/pcma", "rate": 8000}, "voice": "ethan"},
            },
        },
    )
    assert s.instructions == "hi" and s.turn_detection is None and s.voice == "ethan"
    assert s.input_format.name == "g711_ulaw" and s.output_format.rate_hz == 8000
    out = s.to_openai("sess_1")
    assert out["audio"]["output"]["format"] == {"type": "audio/pcma", "rate": 8000}


def test_beta_session_update() -> None:
    s = apply_session_update(
        Settings(),
        {
            "input_audio_format": "g711_alaw",
            "output_audio_format": "pcm16",
            "turn_detection": {"type": "server_vad", "threshold": 0.7, "silence_duration_ms": 300},
            "max_response_output_tokens": 40,
        },
    )
    assert s.input_format.name == "g711_alaw" and s.max_output_tokens == 40
    assert s.turn_detection is not None
    assert s.turn_detection.vad.threshold == 0.7 and s.turn_detection.vad.prefix_padding_ms == 300
    assert s.to_openai("x", beta=True)["turn_detection"]["silence_duration_ms"] == 300


@pytest.mark.parametrize(
    "bad",
    [
        {"input_audio_format": "mp3"},
        {"turn_detection": {"type": "push_to_talk"}},
        {"voice": "ash2"},
        {"tools": [{"type": "mcp", "server_url": "x"}]},
        {"turn_detection": {"threshold": 2}},
        {"temperature": "hot"},
        {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}},
        "not an object",
    ],
)
def test_bad_updates_are_refused_with_the_param(bad: object) -> None:
    with pytest.raises(ProtocolError) as e:
        apply_session_update(Settings(), bad)
    assert str(e.value)


def test_beta_names() -> None:
    assert for_beta({"type": "response.output_audio.delta"})["type"] == "response.audio.delta"
    assert for_beta({"type": "conversation.item.done"}) is None
    item = {"type": "message", "content": [{"type": "output_audio"}, {"type": "input_image"}]}
    ev = for_beta({"type": "conversation.item.added", "item": item})
    assert ev is not None and ev["type"] == "conversation.item.created"
    assert ev["item"]["content"] == [{"type": "audio"}]  # beta has no type for an image
    ev = for_beta({"type": "response.done", "response": {"output": [item]}})
    assert ev is not None and ev["response"]["output"][0]["content"] == [{"type": "audio"}]
    assert error_event("m", "c")["error"]["code"] == "c"


def test_truncation_is_applied_and_shown_or_refused_by_name() -> None:
    s = apply_session_update(Settings(), {"truncation": "disabled"})
    assert s.truncation == "disabled" and s.to_openai("x")["truncation"] == "disabled"
    s = apply_session_update(s, {"truncation": {"type": "retention_ratio", "retention_ratio": 0.8}})
    assert s.truncation == 0.8
    assert s.to_openai("x")["truncation"] == {"type": "retention_ratio", "retention_ratio": 0.8}
    for bad in ("sometimes", {"type": "retention_ratio", "retention_ratio": 2}):
        try:
            apply_session_update(s, {"truncation": bad})
        except ProtocolError as e:
            assert e.param and "truncation" in e.param
        else:
            raise AssertionError(f"{bad!r} was accepted")


def test_a_refused_field_never_drops_the_others() -> None:
    s, refused = apply_with_errors(
        Settings(),
        {
            "type": "realtime",
            "instructions": "be brief",
            "prompt": {"id": "pmpt_1"},
            "audio": {
                "input": {"turn_detection": {"type": "server_vad", "threshold": 7}},
                "output": {"voice": "nobody", "speed": 1.5},
            },
            "max_output_tokens": 50,
        },
    )
    assert s.instructions == "be brief" and s.max_output_tokens == 50
    assert s.voice is None and s.turn_detection is not None  # the defaults stay
    params = sorted(str(e.param) for e in refused)
    assert params == [
        "session.audio.input.turn_detection.threshold",
        "session.audio.output.speed",
        "session.audio.output.voice",
        "session.prompt",
    ]
    voice = next(e for e in refused if e.param == "session.audio.output.voice")
    assert "alloy" in str(voice) and "ethan" in str(voice)  # it names the voices there are


def test_semantic_vad_maps_onto_server_vad_by_eagerness() -> None:
    got = {}
    for eagerness in ("low", "medium", "high", "auto"):
        td = {"type": "semantic_vad", "eagerness": eagerness, "interrupt_response": True}
        s = apply_session_update(Settings(), {"audio": {"input": {"turn_detection": td}}})
        assert s.turn_detection is not None
        got[eagerness] = s.turn_detection.vad.silence_duration_ms
        shown = s.to_openai("x")["audio"]["input"]["turn_detection"]
        assert shown["type"] == "semantic_vad" and shown["eagerness"] == eagerness
    assert got["low"] > got["medium"] == got["auto"] > got["high"]
    s = apply_session_update(s, {"turn_detection": {"type": "server_vad"}})
    assert s.turn_detection is not None and s.turn_detection.eagerness is None
    assert s.turn_detection.vad.silence_duration_ms == 500  # server_vad's own again


def test_voices_map_openai_names_onto_the_checkpoints_speakers() -> None:
    voices = Voices({"alloy": "chelsie", "ash": "ethan"})
    assert voices.speaker("Alloy") == "chelsie" and voices.speaker("ethan") == "ethan"
    assert voices.names() == ["alloy", "ash", "chelsie", "ethan"]
    s, refused = apply_with_errors(Settings(), {"voice": "ash"}, voices)
    assert s.voice == "ash" and refused == []
    _, refused = apply_with_errors(Settings(), {"voice": "verse"}, voices)
    assert [e.param for e in refused] == ["session.voice"]


def test_tools_tool_choice_modalities_transcription() -> None:
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    s = apply_session_update(
        Settings(),
        {
            "tools": [tool],
            "tool_choice": "required",
            "output_modalities": ["text"],
            "audio": {"input": {"transcription": {"model": "whisper-1", "language": "en"}}},
            "tracing": "auto",
        },
    )
    assert [t.name for t in s.tools] == ["get_weather"] and s.tool_choice == "required"
    assert s.text_only and s.transcription is not None and s.transcription.language == "en"
    out = s.to_openai("x")
    assert out["tools"] == [tool] and out["output_modalities"] == ["text"]
    assert out["audio"]["input"]["transcription"]["model"] == "whisper-1"
    _, refused = apply_with_errors(
        Settings(), {"audio": {"input": {"noise_reduction": {"type": "near_field"}}}}, None, False
    )
    assert [e.code for e in refused] == ["unsupported_value"]  # no suppressor installed
    s, refused = apply_with_errors(
        Settings(), {"audio": {"input": {"noise_reduction": {"type": "far_field"}}}}, None, True
    )
    assert refused == [] and s.noise_reduction == "far_field"


def _png_header(width: int, height: int) -> bytes:
    """A PNG's signature and IHDR (8-bit RGB) with no pixel data: what a header check sees."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def _image_item(raw: bytes, kind: str = "png") -> dict[str, object]:
    import base64

    url = f"data:image/{kind};base64," + base64.b64encode(raw).decode()
    return {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_image", "image_url": url}],
    }


def test_an_image_is_judged_by_its_header_before_it_is_decoded() -> None:
    """A 13,000 x 13,000 PNG of 219 KB decoded to 809 MB before; now its header refuses it."""
    import io

    from PIL import Image

    with pytest.raises(ProtocolError) as e:
        parse_item(_image_item(_png_header(13000, 13000)), PCM16)
    assert e.value.code == "image_too_large" and "13000 x 13000" in str(e.value)
    gif = io.BytesIO()
    Image.new("RGB", (8, 8)).save(gif, "GIF")
    with pytest.raises(ProtocolError, match="formats taken"):
        parse_item(_image_item(gif.getvalue(), "gif"), PCM16)
    png = io.BytesIO()
    Image.new("RGB", (2000, 1000), (200, 10, 10)).save(png, "PNG")
    image = parse_item(_image_item(png.getvalue()), PCM16).parts[0].image
    assert image is not None and image.shape == (640, 1280, 3)


def test_a_null_field_is_left_as_it_is_unless_null_turns_it_off() -> None:
    """OpenAI's SDK models send a field set to None as null: LiveKit's `response.create` carries
    `instructions: null` (no override), which was refused as "must be a string"."""
    s = apply_session_update(
        Settings(), {"instructions": "be brief", "voice": "ash", "max_output_tokens": 50}
    )
    nulls = {
        "instructions": None,
        "voice": None,
        "temperature": None,
        "max_output_tokens": None,
        "tool_choice": None,
        "tools": None,
        "output_modalities": None,
        "truncation": None,
        "audio": {"output": {"voice": None, "format": None}, "input": {"format": None}},
    }
    assert apply_session_update(s, nulls) == s
    off = {"audio": {"input": {"turn_detection": None, "transcription": None}}, "tracing": None}
    s = apply_session_update(
        apply_session_update(s, {"input_audio_transcription": {"model": "whisper-1"}}), off
    )
    assert s.turn_detection is None and s.transcription is None and s.tracing is None


def test_a_response_creates_refusals_name_the_response() -> None:
    _, refused = apply_with_errors(
        Settings(), {"instructions": 5, "voice": "nobody"}, where="response"
    )
    assert sorted(str(e.param) for e in refused) == ["response.instructions", "response.voice"]


def test_response_metadata_is_up_to_16_string_pairs() -> None:
    from realtime_omni.gateway.protocol.events import parse_metadata

    assert parse_metadata({"client_event_id": "response_create_1"}, "m") == {
        "client_event_id": "response_create_1"
    }
    assert parse_metadata(None, "m") is None
    for bad in (
        "x",
        {"n": 1},
        {str(i): "v" for i in range(17)},
        {"k" * 65: "v"},
        {"k": "v" * 513},
    ):
        with pytest.raises(ProtocolError) as e:
            parse_metadata(bad, "response.metadata")
        assert e.value.param == "response.metadata"


def test_json_past_the_value_cap_is_refused_before_it_is_parsed() -> None:
    import time

    many = "[" + ",".join(["[]"] * 500_000) + "]"  # 1.5 MB: its parse and walk took 0.7 s
    start = time.perf_counter()
    with pytest.raises(ProtocolError) as e:
        loads(many, "the event")
    assert e.value.code == "invalid_json" and f"{MAX_JSON_NODES} values" in str(e.value)
    assert time.perf_counter() - start < 0.5
    # What looks like structure inside a string is text: no false refusal.
    text = {"type": "x", "text": '[{a, "b"}],\\' * 100_000}
    assert loads(json.dumps(text)) == text
    assert loads(json.dumps(text).encode()) == text
    assert json_values_at_most(json.dumps(text)) == 4


def test_the_value_count_never_undercounts_whatever_the_strings_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def values(v: object) -> int:
        inner = v.values() if isinstance(v, dict) else v if isinstance(v, list) else []
        return 1 + sum(values(x) for x in inner)

    odd = ['a,b[{"\\', '"q, [x]"', "\\", "\\\\", '\\"', "{}", ",,,", ""]
    docs = [
        {"k,[": odd, "v": [[], [odd, {"\\": {}}], 1, None]},
        [odd, [odd, odd], {"\"'": [{}, [], ""]}],
        {f'k{i}"': [i, str(i) * i, "]" * i] for i in range(40)},
    ]
    for piece in (1, 2, 3, 5, 1 << 18):  # escapes and strings across the pieces' bounds
        monkeypatch.setattr(events, "_SCAN_PIECE", piece)
        for doc in docs:
            raw = json.dumps(doc)
            assert values(doc) <= json_values_at_most(raw) <= 3 * values(doc)


def test_settings_grown_past_their_bound_are_refused_so_no_tiny_update_echoes_megabytes() -> None:
    """Instructions and tools sent in separate messages (each under the 8 MiB message cap)
    once grew a session's settings without bound, and every 40-byte `session.update` echoed
    them all in its `session.updated`."""
    from realtime_omni.gateway.protocol.session_update import MAX_SETTINGS_BYTES

    s = apply_session_update(Settings(), {"instructions": "i" * (300 << 10)})
    tool = {"type": "function", "name": "t", "parameters": {"description": "d" * (300 << 10)}}
    with pytest.raises(ProtocolError) as e:
        apply_with_errors(s, {"tools": [tool]})
    assert e.value.code == "session_too_large" and "nothing was applied" in str(e.value)
    with pytest.raises(ProtocolError):
        apply_with_errors(s, {"tracing": {"metadata": {"k": "x" * (300 << 10)}}})
    again, refused = apply_with_errors(s, {})
    assert again == s and not refused
    assert len(json.dumps(again.to_openai("sess"))) <= MAX_SETTINGS_BYTES
