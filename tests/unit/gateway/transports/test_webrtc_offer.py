"""What an offer may ask of the server before it is parsed: a few media sections, a few ICE
candidates (each gets STUN checks: UDP to where the offer says), a form of a few parts."""

from __future__ import annotations

import json
import time

from tests.conftest import timeout
from tests.unit.gateway.app_harness import gateway_server, offer


def test_an_offer_with_many_media_sections_or_candidates_is_refused_unparsed() -> None:
    sdp = offer()
    many_m = sdp + "m=audio 9 UDP/TLS/RTP/SAVPF 111\r\n" * 800
    head, rest = sdp.split("\r\na=mid:", 1)
    candidates = "".join(
        f"\r\na=candidate:{i} 1 udp 2130706431 10.9.{i // 250}.{i % 250 + 1} 9 typ host"
        for i in range(100)
    )
    many_c = head + candidates + "\r\na=mid:" + rest
    with gateway_server() as srv:
        for body, code in [
            (many_m, "too_many_media_sections"),
            (many_c, "too_many_ice_candidates"),
        ]:
            t = time.monotonic()
            status, _, raw = srv.request(
                "POST", "/v1/whip", body.encode(), {"Content-Type": "application/sdp"}
            )
            assert status == 400 and json.loads(raw)["error"]["code"] == code, raw[:200]
            assert time.monotonic() - t < timeout(0.3)
        assert srv.gw.sessions == set()
        ok = srv.request("POST", "/v1/whip", sdp.encode(), {"Content-Type": "application/sdp"})
        assert ok[0] == 201  # a browser's offer goes on


def test_a_form_of_many_parts_is_refused_unparsed() -> None:
    """20,000 parts in 1 MiB held the event loop 6.7 s in the MIME parser."""
    b = "bnd"
    parts = "".join(
        f'--{b}\r\nContent-Disposition: form-data; name="p{i}"\r\n\r\nx\r\n' for i in range(15000)
    )
    body = (parts + f"--{b}--\r\n").encode()
    with gateway_server() as srv:
        t = time.monotonic()
        status, _, raw = srv.request(
            "POST", "/v1/realtime/calls", body,
            {"Content-Type": f"multipart/form-data; boundary={b}"},
        )  # fmt: skip
        assert status == 413 and b"at most 8 parts" in raw
        assert time.monotonic() - t < timeout(0.3)
