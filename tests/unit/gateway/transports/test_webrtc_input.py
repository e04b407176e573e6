"""A WebRTC call's audio receiver hears through `webrtc_input.CallerAudio`, waiting as long as
`realtime.webrtc_reorder_packets` says; null keeps aiortc's own jitter buffer. (The audio itself,
over a lossy link: tests/integration/test_webrtc_input.py.)"""

from __future__ import annotations

from typing import Any

import pytest
from aiortc.jitterbuffer import JitterBuffer

from realtime_omni.gateway.transports.webrtc_input import CallerAudio
from tests.unit.gateway.app_harness import gateway_server, offer


def receiver_buffer(realtime: dict[str, Any]) -> Any:
    with gateway_server(realtime=realtime) as srv:
        status, _, _ = srv.request(
            "POST", "/v1/whip", offer().encode(), {"Content-Type": "application/sdp"}
        )
        assert status == 201
        (call,) = srv.app.state.webrtc.calls.values()
        (t,) = [t for t in call.pc.getTransceivers() if t.kind == "audio"]
        return t.receiver._RTCRtpReceiver__jitter_buffer


@pytest.mark.parametrize("wait", [1, 3])
def test_the_caller_audio_takes_the_place_of_aiortcs_jitter_buffer(wait: int) -> None:
    buffer = receiver_buffer({"webrtc_reorder_packets": wait})
    assert isinstance(buffer, CallerAudio) and buffer.reorder.wait_packets == wait


def test_null_keeps_aiortcs_jitter_buffer() -> None:
    assert isinstance(receiver_buffer({"webrtc_reorder_packets": None}), JitterBuffer)
