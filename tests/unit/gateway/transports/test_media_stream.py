"""The media-stream bridges' pieces without a server: the providers' dialects, the marks'
accounting of what was heard, the phone config, and 8 kHz audio through streaming resamplers."""

from __future__ import annotations

import numpy as np
import pytest

from realtime_omni.errors import ConfigError
from realtime_omni.gateway.config import PhoneConfig, SipConfig, _section, merge
from realtime_omni.gateway.media.audio import Resampler, resample, ulaw_decode, ulaw_encode
from realtime_omni.gateway.transports.dialects import DIALECTS, BadMessage
from realtime_omni.gateway.transports.media_stream import Heard


def test_each_dialect_reads_its_providers_start() -> None:
    twilio = DIALECTS["twilio"].parse(
        {
            "event": "start",
            "streamSid": "MZ1",
            "start": {
                "streamSid": "MZ1",
                "callSid": "CA1",
                "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
                "customParameters": {"voice": "Ethan"},
            },
        }
    )
    assert twilio.start and twilio.start.stream_id == "MZ1" and twilio.start.call_id == "CA1"
    assert twilio.start.codec == "ulaw" and twilio.start.parameters == {"voice": "Ethan"}
    telnyx = DIALECTS["telnyx"].parse(
        {
            "event": "start",
            "stream_id": "s1",
            "start": {"call_control_id": "v3:1", "media_format": {"encoding": "PCMA"}},
        }
    )
    assert telnyx.start and telnyx.start.codec == "alaw" and telnyx.start.stream_id == "s1"
    plivo = DIALECTS["plivo"].parse(
        {
            "event": "start",
            "start": {"streamId": "p1", "callId": "c1", "extra_headers": "a=1, b = two"},
        }
    )
    assert plivo.start and plivo.start.parameters == {"a": "1", "b": "two"}
    assert DIALECTS["plivo"].parse({"event": "playedStream", "name": "m3"}).payload == "m3"
    assert DIALECTS["plivo"].parse({"event": "clearedAudio"}).kind == "cleared"
    # Telnyx with both tracks sends the bot's own audio back: not the caller's
    out = {"event": "media", "media": {"track": "outbound", "payload": "AA=="}}
    assert DIALECTS["telnyx"].parse(out).kind == "ignored"


@pytest.mark.parametrize(
    "msg",
    [
        {"event": "nonsense"},
        {"event": "media"},
        {"event": "media", "media": {"payload": 3}},
        {"event": "start", "start": {"streamSid": "MZ1"}},  # no callSid
        {"event": "start", "start": "x"},
        {
            "event": "start",
            "start": {"streamSid": "a", "callSid": "b", "mediaFormat": {"encoding": "audio/l16"}},
        },
        {
            "event": "start",
            "start": {"streamSid": "a", "callSid": "b", "mediaFormat": {"sampleRate": 16000}},
        },
    ],
)
def test_a_malformed_message_is_a_bad_message(msg: dict) -> None:
    with pytest.raises(BadMessage):
        DIALECTS["twilio"].parse(msg)


def test_outgoing_messages_use_each_providers_names() -> None:
    assert DIALECTS["twilio"].clear("MZ1") == {"event": "clear", "streamSid": "MZ1"}
    assert DIALECTS["telnyx"].clear("s") == {"event": "clear"}
    assert DIALECTS["plivo"].clear("p") == {"event": "clearAudio", "streamId": "p"}
    assert DIALECTS["plivo"].media("p", "AA==")["event"] == "playAudio"
    assert DIALECTS["plivo"].mark("p", "m1") == {
        "event": "checkpoint",
        "streamId": "p",
        "name": "m1",
    }
    assert DIALECTS["twilio"].mark("MZ", "m1")["mark"] == {"name": "m1"}


def test_heard_follows_echoed_marks_and_a_clear_voids_the_pending_ones() -> None:
    h = Heard()
    names = [h.sent("item_a", end) for end in (160, 320, 480, 640)]
    h.echoed(names[1])  # a provider may skip one: the later mark covers it
    assert h.heard == {"item_a": 320} and h.pending
    h.cleared()  # barge-in: the provider echoes the rest, but that audio never played
    for n in names[2:]:
        h.echoed(n)
    assert h.heard == {"item_a": 320} and not h.pending
    h.echoed("forged")
    assert h.heard == {"item_a": 320}


def test_heard_keeps_a_bounded_number_of_marks() -> None:
    h = Heard()
    for i in range(5000):
        h.sent("item_a", i)
    assert len(h.marks) == 3000


def test_phone_routes_lay_a_provider_over_the_default() -> None:
    cfg = PhoneConfig.model_validate(
        {
            "routes": {
                "default": {"session": {"instructions": "hi", "audio": {"output": {"voice": "A"}}}},
                "twilio": {"session": {"audio": {"output": {"voice": "B"}}}},
            }
        }
    )
    assert cfg.session_for("twilio") == {"instructions": "hi", "audio": {"output": {"voice": "B"}}}
    assert cfg.session_for("plivo")["audio"]["output"]["voice"] == "A"
    assert merge({"a": {"b": 1, "c": 2}}, {"a": {"c": 3}}) == {"a": {"b": 1, "c": 3}}


def test_gateway_sections_refuse_bad_fields_by_name() -> None:
    with pytest.raises(ConfigError, match=r"phone\.lead_ms"):
        _section(PhoneConfig, {"phone": {"lead_ms": -1}}, "phone")
    with pytest.raises(ConfigError, match=r"phone\.routes\.pstn"):
        _section(PhoneConfig, {"phone": {"routes": {"pstn": {}}}}, "phone")
    with pytest.raises(ConfigError, match="not an IP address"):
        _section(SipConfig, {"sip": {"allowed_peers": ["example.com"]}}, "sip")
    sip = _section(SipConfig, {"sip": {"allowed_peers": ["10.0.0.0/8", "192.0.2.7"]}}, "sip")
    assert sip.allows("10.1.2.3") and sip.allows("192.0.2.7")
    assert not sip.allows("192.0.2.8") and not sip.allows("not-an-address")


def _sine(rate: int, seconds: float, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


@pytest.mark.parametrize(("src", "dst", "chunk"), [(8000, 16000, 160), (24000, 8000, 1920)])
def test_phone_audio_resampled_in_chunks_has_no_seams(src: int, dst: int, chunk: int) -> None:
    """20 ms phone frames in (8 -> 16 kHz for the VAD and the model) and 80 ms vocoder chunks
    out (24 -> 8 kHz): streamed chunk by chunk, the result is the one-shot resampling, so no
    click at a chunk's seam."""
    x = _sine(src, 1.0)
    r = Resampler(src, dst)
    streamed = np.concatenate([*(r.process(x[i : i + chunk]) for i in range(0, len(x), chunk)),
                               r.flush()])  # fmt: skip
    whole = resample(x, src, dst)
    n = min(len(streamed), len(whole)) - dst // 100
    assert n > 0.9 * dst
    assert np.max(np.abs(streamed[:n] - whole[:n])) < 1e-3
    assert np.max(np.abs(np.diff(streamed[dst // 100 : n]))) < 0.5 * 2 * np.pi * 440 / dst * 1.1


def test_g711_round_trip_keeps_speech_levels() -> None:
    x = _sine(8000, 0.1)
    y = ulaw_decode(ulaw_encode(x))
    assert np.max(np.abs(x - y)) < 0.02
