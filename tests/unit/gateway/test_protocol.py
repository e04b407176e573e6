import pytest

from realtime_omni.gateway.protocol import (
    ProtocolError,
    Settings,
    apply_session_update,
    error_event,
    for_beta,
)


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
        {"turn_detection": {"type": "semantic_vad"}},
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
    from realtime_omni.gateway.protocol import ProtocolError, Settings, apply_session_update

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
