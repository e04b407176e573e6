"""Who may do what (`auth.py`): keys, and client secrets kept to their own calls, through the
whole app on real sockets."""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import quote

import pytest

from realtime_omni.gateway.auth import Auth
from tests.conftest import timeout
from tests.unit.gateway.app_harness import (
    Served,
    bearer,
    gateway_server,
    multipart,
    offer,
    recv_json,
    refused,
)

KEY = "sk-unit-0123"


def mint(srv: Served, session: dict[str, Any] | None = None) -> str:
    status, body = srv.post_json(
        "/v1/realtime/client_secrets", {"session": session or {}}, bearer(KEY)
    )
    assert status == 200, body
    return str(body["value"])


def whip(srv: Served, token: str, sdp: str) -> tuple[int, dict[str, str], bytes]:
    headers = {**bearer(token), "Content-Type": "application/sdp"}
    return srv.request("POST", "/v1/whip", sdp.encode(), headers)


def call_of(srv: Served, location: str) -> Any:
    return srv.app.state.webrtc.calls.get(location.rsplit("/", 1)[1])


@pytest.mark.parametrize("token", ["sk-unit-012\xe9", "\x00\xff", "ключ", "ek_\u2603"])
def test_a_token_of_any_characters_is_refused_not_raised(token: str) -> None:
    auth = Auth([KEY])
    assert auth.check(token) is None
    assert auth.check(KEY) is not None


def test_a_non_ascii_token_over_http_gets_401_not_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with gateway_server(keys=KEY) as srv:
        # A header carries latin-1 (what a client may put there), `?token=` UTF-8.
        status, _, body = srv.request("GET", "/v1/stats", headers={"Authorization": b"Bearer \xe9"})
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        status, _, _ = srv.request("POST", f"/v1/phone/twilio/voice?token={quote('ключ')}", b"")
        assert status == 401
        assert refused(srv, "/v1/realtime", {"Authorization": "Bearer \xe9\u2603"}) == 403
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_the_secret_store_is_capped_by_bytes() -> None:
    auth = Auth([KEY], max_bytes=100_000)
    big = {"instructions": "x" * 20_000}
    values = [auth.mint(big)[0] for _ in range(20)]
    assert auth.held_bytes <= 100_000
    assert auth.check(values[-1]) is not None  # the newest are kept
    assert auth.check(values[0]) is None  # the oldest went
    assert sum(auth.check(v) is not None for v in values) == 4


def test_a_client_secret_reaches_the_call_routes_only() -> None:
    with gateway_server(keys=KEY) as srv:
        secret = mint(srv)
        for method, path in [
            ("GET", "/v1/stats"),
            ("GET", "/metrics"),
            ("GET", "/v1/metrics"),
            ("GET", "/readyz"),
            ("POST", "/v1/realtime/client_secrets"),  # no minting by a secret
            ("POST", "/v1/phone/twilio/voice"),  # nor renewing it through the webhook
            ("POST", f"/v1/phone/twilio/voice?token={secret}"),
        ]:
            status, _, body = srv.request(method, path, b"", bearer(secret))
            assert status == 403, (path, status)
            assert json.loads(body)["error"]["code"] == "forbidden" and b"<Stream" not in body
            assert srv.request(method, path, b"", bearer(KEY))[0] < 400, path
        assert refused(srv, f"/v1/phone/telnyx?token={secret}", {}) == 403  # no phone stream
        with srv.websocket("/v1/realtime", bearer(secret)) as ws:  # its own call: yes
            assert recv_json(ws)["type"] == "session.created"


def test_the_webhooks_stream_secret_starts_a_phone_stream_only() -> None:
    with gateway_server(keys=KEY) as srv:
        status, _, body = srv.request("POST", f"/v1/phone/twilio/voice?token={KEY}", b"CallSid=1")
        assert status == 200
        token = body.decode().split('name="token" value="')[1].split('"')[0]
        assert token.startswith("ek_")
        assert srv.request("GET", "/v1/stats", None, bearer(token))[0] == 403
        assert srv.request("POST", "/v1/whip", b"", bearer(token))[0] == 403
        assert refused(srv, "/v1/realtime", bearer(token)) == 403


def test_every_call_a_secret_starts_has_its_session_and_one_place() -> None:
    sdp = offer()
    with gateway_server(keys=KEY, max_sessions=8) as srv:
        for path in ("/v1/whip", "/v1/webrtc/offer", "/v1/realtime/calls"):
            secret = mint(srv, {"instructions": f"bound by {path}"})
            if path == "/v1/webrtc/offer":
                status, body = srv.post_json(path, {"sdp": sdp, "type": "offer"}, bearer(secret))
                location = f"/v1/whip/{body['session_id']}"
            else:
                headers = {**bearer(secret), "Content-Type": "application/sdp"}
                status, headers, body = srv.request("POST", path, sdp.encode(), headers)
                location = headers["location"]
            assert status in (200, 201), body
            assert call_of(srv, location).session.settings.instructions == f"bound by {path}"
            # one live session per secret (realtime.client_secret_max_sessions)
            with srv.websocket("/v1/realtime", bearer(secret)) as ws:
                err = recv_json(ws)
                assert err["error"]["code"] == "client_secret_session_limit", err
        assert len(srv.gw.sessions) == 3  # each secret held one place, and the key gets its own
        with srv.websocket("/v1/realtime", bearer(KEY)) as ws:
            assert recv_json(ws)["type"] == "session.created"


def test_a_transcription_secret_cannot_start_an_answering_call() -> None:
    sdp = offer()
    with gateway_server(keys=KEY, max_sessions=8) as srv:
        for asked, status in (("realtime", 400), ("transcription", 201), (None, 201)):
            secret = mint(srv, {"type": "transcription"})
            session = {} if asked is None else {"type": asked}
            body, kind = multipart(sdp, json.dumps(session).encode())
            headers = {**bearer(secret), "Content-Type": kind}
            got, headers, raw = srv.request("POST", "/v1/realtime/calls", body, headers)
            assert got == status, raw
            if status == 400:
                assert b"invalid_session" in raw and b"transcription session" in raw
            else:
                call = call_of(srv, headers["location"])
                assert call.session.settings.type == "transcription"


def test_a_secret_may_end_and_watch_its_own_call_only() -> None:
    sdp = offer()
    with gateway_server(keys=KEY) as srv:
        mine, other = mint(srv), mint(srv)
        location = whip(srv, mine, sdp)[1]["location"]
        call_id = location.rsplit("/", 1)[1]
        side = f"/v1/realtime?call_id={call_id}"
        # another grant's call is "no such call"
        assert srv.request("DELETE", location, None, bearer(other))[0] == 404
        hangup = f"/v1/realtime/calls/{call_id}/hangup"
        assert srv.request("POST", hangup, b"", bearer(other))[0] == 404
        assert refused(srv, side, bearer(other)) == 403
        for token in (mine, KEY):  # its own secret and the key's holder may watch it
            with srv.websocket(side, bearer(token)) as ws:
                assert recv_json(ws)["type"] == "session.updated"
        assert srv.request("DELETE", location, None, bearer(mine))[0] == 200


def test_an_offer_never_takes_another_grants_pending_place() -> None:
    sdp = offer()
    with gateway_server(keys=f"{KEY},sk-other", max_sessions=2) as srv:
        held = [whip(srv, KEY, sdp)[1]["location"] for _ in range(2)]
        status, _, body = whip(srv, mint(srv), sdp)
        assert status == 503, body  # the key's pending offers keep their places
        assert whip(srv, "sk-other", sdp)[0] == 503  # from another key's offer too
        assert all(call_of(srv, loc) is not None for loc in held)
        # the same grant's newest offer takes its own oldest pending place, as before
        assert whip(srv, KEY, sdp)[0] == 201
        assert call_of(srv, held[0]) is None and call_of(srv, held[1]) is not None


def test_a_secret_starts_its_stated_number_of_sessions_not_one_after_another() -> None:
    """realtime.client_secret_max_sessions (1): a call ended does not let the same secret start
    another; a key mints a new secret for the next call."""
    with gateway_server(keys=KEY) as srv:
        secret = mint(srv, {})
        with srv.websocket("/v1/realtime", bearer(secret)) as ws:
            assert recv_json(ws)["type"] == "session.created"
        deadline = time.monotonic() + timeout(5)
        while srv.gw.sessions:  # the ended call let go of its place
            assert time.monotonic() < deadline, "the closed session was not forgotten"
            time.sleep(0.01)
        with srv.websocket("/v1/realtime", bearer(secret)) as ws:
            err = recv_json(ws)
            assert err["error"]["code"] == "client_secret_used", err
        with srv.websocket("/v1/realtime", bearer(mint(srv, {}))) as ws:
            assert recv_json(ws)["type"] == "session.created"


def test_a_key_acts_on_its_own_calls_and_an_admin_key_on_all() -> None:
    """Keys are not one trust level: another key's call is "no such call" (it was every key's);
    the key that minted a secret owns the secret's calls; an admin key acts on every call."""
    sdp = offer()
    env = {"TEST_ADMIN_KEYS": "sk-admin"}
    realtime = {"admin_api_keys_env": "TEST_ADMIN_KEYS"}
    with gateway_server(keys=f"{KEY},sk-other", env=env, realtime=realtime) as srv:
        for starter in (KEY, mint(srv)):  # the key's own call, and one of a secret it minted
            location = whip(srv, starter, sdp)[1]["location"]
            call_id = location.rsplit("/", 1)[1]
            assert srv.request("DELETE", location, None, bearer("sk-other"))[0] == 404
            assert refused(srv, f"/v1/realtime?call_id={call_id}", bearer("sk-other")) == 403
            with srv.websocket(f"/v1/realtime?call_id={call_id}", bearer("sk-admin")) as ws:
                assert recv_json(ws)["type"] == "session.updated"
            assert srv.request("DELETE", location, None, bearer(KEY))[0] == 200
        location = whip(srv, "sk-other", sdp)[1]["location"]
        assert srv.request("DELETE", location, None, bearer("sk-admin"))[0] == 200
