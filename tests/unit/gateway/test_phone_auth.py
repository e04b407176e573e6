"""What a phone provider's requests must show before they cost anything: a signed webhook, a
bounded body, few streams waiting unauthenticated, small messages before `start`, and a stream
token that is a key or the webhook's own secret."""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import parse_qs

import pytest
import websockets

from realtime_omni.gateway.transports.phone import twilio_signature
from tests.conftest import timeout
from tests.unit.gateway.app_harness import Served, bearer, gateway_server, refused

KEY = "sk-unit-0123"
TOKEN_ENV = "RTO_TEST_TWILIO_TOKEN"


def test_the_twilio_signature_is_twilios() -> None:
    """Twilio's documented example (its request-validation docs and helper libraries)."""
    form = {
        "CallSid": ["CA1234567890ABCDE"],
        "Caller": ["+14158675309"],
        "Digits": ["1234"],
        "From": ["+14158675309"],
        "To": ["+18005551212"],
    }
    url = "https://mycompany.com/myapp.php?foo=1&bar=2"
    assert twilio_signature("12345", url, form) == "RSOYDt4T1cUTdK1PDd93/VVr8B8="


def test_the_voice_webhook_takes_only_requests_twilio_signed() -> None:
    env = {TOKEN_ENV: "twilio-auth-token"}
    with gateway_server(keys=KEY, env=env, phone={"twilio_auth_token_env": TOKEN_ENV}) as srv:
        path = f"/v1/phone/twilio/voice?token={KEY}"
        body = b"CallSid=CA1&From=%2B15550100&To=%2B15550199"
        kind = {"Content-Type": "application/x-www-form-urlencoded"}
        assert srv.request("POST", path, body, kind)[0] == 403  # unsigned
        url = f"http://127.0.0.1:{srv.port}{path}"
        good = twilio_signature("twilio-auth-token", url, parse_qs(body.decode()))
        forged = twilio_signature("another-token", url, parse_qs(body.decode()))
        assert srv.request("POST", path, body, {**kind, "X-Twilio-Signature": forged})[0] == 403
        status, _, twiml = srv.request("POST", path, body, {**kind, "X-Twilio-Signature": good})
        assert status == 200 and b"<Stream" in twiml
        # a body changed under the signature
        changed = body.replace(b"CA1", b"CA2")
        assert srv.request("POST", path, changed, {**kind, "X-Twilio-Signature": good})[0] == 403


def test_a_webhook_body_is_read_with_a_limit() -> None:
    with gateway_server(keys=KEY) as srv:
        path = f"/v1/phone/twilio/voice?token={KEY}"
        status, _, body = srv.request("POST", path, b"CallSid=" + b"x" * (1 << 20))
        assert status == 413 and json.loads(body)["error"]["code"] == "too_large"
        assert srv.request("POST", path, b"CallSid=CA1")[0] == 200


def start(token: str | None = None) -> str:
    params = {"token": token} if token else {}
    return json.dumps(
        {
            "event": "start",
            "streamSid": "MZ1",
            "start": {
                "streamSid": "MZ1",
                "callSid": "CA1",
                "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000},
                "customParameters": params,
            },
        }
    )


def test_few_streams_may_wait_for_start_and_only_small_messages_before_it() -> None:
    with gateway_server(keys=KEY, phone={"max_pending_streams": 2}) as srv:
        waiting = [srv.websocket("/v1/phone/twilio") for _ in range(2)]
        assert refused(srv, "/v1/phone/twilio", {}) == 403  # a third is closed at once
        # before `start` nothing large: the stream ends at once, it is not read and dropped
        t = time.monotonic()
        waiting[0].send("x" * (100 << 10))
        with pytest.raises(websockets.ConnectionClosed):
            waiting[0].recv(timeout=timeout(5))
        assert time.monotonic() - t < timeout(2)
        deadline = time.monotonic() + timeout(5)
        while len(srv.app.state.phones.live) > 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with srv.websocket("/v1/phone/twilio"):  # its place is free again
            pass
        waiting[1].close()


def stream_with(srv: Served, token: str) -> Any:
    """A Twilio stream that shows `token` in `start`; the session it got, or None."""
    with srv.websocket("/v1/phone/twilio") as ws:
        ws.send(start(token))
        deadline = time.monotonic() + timeout(5)
        while time.monotonic() < deadline:
            live = [c.session for c in srv.app.state.phones.live if c.session is not None]
            if live:
                return live[0]
            try:
                ws.recv(timeout=0.02)
            except TimeoutError:
                continue
            except websockets.ConnectionClosed:
                return None
    return None


def test_a_stream_takes_a_key_or_the_webhooks_secret_not_a_browsers() -> None:
    with gateway_server(keys=KEY) as srv:
        status, browser = srv.post_json("/v1/realtime/client_secrets", {}, bearer(KEY))
        assert status == 200
        assert stream_with(srv, browser["value"]) is None
        assert stream_with(srv, "not-a-token") is None
        _, _, twiml = srv.request("POST", f"/v1/phone/twilio/voice?token={KEY}", b"CallSid=1")
        webhook = twiml.decode().split('name="token" value="')[1].split('"')[0]
        assert stream_with(srv, webhook) is not None
