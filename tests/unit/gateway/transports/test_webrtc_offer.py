"""What an offer may ask of the server before it is parsed: a few media sections, a few ICE
candidates (each gets STUN checks: UDP to where the offer says), a form of a few parts."""

from __future__ import annotations

import json
import time

from realtime_omni.gateway.config import GatewayConfig
from realtime_omni.gateway.transports.webrtc import check_offer, denied_networks
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


def with_candidates(sdp: str, addresses: list[str]) -> str:
    head, rest = sdp.split("\r\na=mid:", 1)
    lines = "".join(
        f"\r\na=candidate:{i} 1 udp 2130706431 {a} 9 typ host" for i, a in enumerate(addresses)
    )
    return head + lines + "\r\na=mid:" + rest


def test_candidates_in_denied_networks_are_left_out_of_the_offer() -> None:
    """The cloud's metadata service and link-local addresses get no STUN checks from the
    server; loopback, private addresses and mDNS names stay."""
    denied = denied_networks(GatewayConfig().ice_denied_networks)
    metadata = ["169.254.169.254", "169.254.3.1", "fe80::1", "fd00:ec2::254", "224.0.0.251"]
    fine = ["127.0.0.1", "10.1.2.3", "2001:db8::7", "4c1f2b1e-1b2a-4c5d-9e8f-0a1b2c3d4e5f.local"]
    taken = check_offer(with_candidates(offer(), metadata + fine), denied)
    named = [line.split()[4] for line in taken.splitlines() if line.startswith("a=candidate:")]
    assert not set(metadata) & set(named) and set(fine) <= set(named)
    plain = offer()
    assert check_offer(plain, denied) == plain  # nothing to take out: the offer as it came


def test_every_webrtc_route_holds_an_offer_to_the_same_bounds() -> None:
    """The Live API's offer (in a JSON body of up to 1 MiB) is held to the Realtime offer's
    size and counts; a denied candidate does not stop a call being answered."""
    sdp = offer()
    big = sdp + "a=x-pad:" + "p" * (300 << 10) + "\r\n"
    many = with_candidates(sdp, [f"10.9.0.{i + 1}" for i in range(100)])
    with gateway_server() as srv:
        for body, status, code in [
            (big, 413, "too_large"),
            (many, 400, "too_many_ice_candidates"),
        ]:
            raw = json.dumps(
                {"session": {"model": "qwen3-omni"}, "transport": {"type": "webrtc", "sdp": body}}
            ).encode()
            got = srv.request(
                "POST", "/v1/live/sessions", raw, {"Content-Type": "application/json"}
            )
            assert got[0] == status and json.loads(got[2])["error"]["code"] == code, got[2][:200]
            got = srv.request(
                "POST", "/v1/whip", body.encode(), {"Content-Type": "application/sdp"}
            )
            assert got[0] == status and json.loads(got[2])["error"]["code"] == code, got[2][:200]
        assert srv.gw.sessions == set()
        metadata = with_candidates(sdp, ["169.254.169.254"])
        ok = srv.request("POST", "/v1/whip", metadata.encode(), {"Content-Type": "application/sdp"})
        assert ok[0] == 201
