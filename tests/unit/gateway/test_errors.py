"""Every error the gateway raises on purpose is an `OmniError`, so one `except` at a boundary
catches them all (issue 32, item 4)."""

from __future__ import annotations

import pytest

from realtime_omni.errors import OmniError
from realtime_omni.gateway.media.playout import PlayoutFull
from realtime_omni.gateway.protocol.events import ProtocolError
from realtime_omni.gateway.transports.dialects import BadMessage
from realtime_omni.gateway.transports.webrtc import SignallingError
from realtime_omni.pipeline.messages import Malformed


@pytest.mark.parametrize(
    "error", [ProtocolError, SignallingError, BadMessage, PlayoutFull, Malformed]
)
def test_each_is_under_the_one_root(error: type[Exception]) -> None:
    assert issubclass(error, OmniError)
