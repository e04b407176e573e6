"""What a phone provider's requests must show before they cost anything: a signed webhook and
signed stream upgrades (Twilio, Plivo), a bounded body, few streams waiting unauthenticated,
small messages before `start`, and a stream token that is a key or the webhook's own secret."""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import parse_qs

import pytest
import websockets

from realtime_omni.gateway.config import PhoneConfig
from realtime_omni.gateway.transports.media_stream import pending_refusal
from realtime_omni.gateway.transports.signatures import (
    Replays,
    plivo_signature,
    plivo_signature_ok,
    twilio_signature,
    twilio_signature_ok,
)
from tests.conftest import timeout
from tests.unit.gateway.app_harness import Served, bearer, gateway_server, refused

KEY = "sk-unit-0123"
TOKEN_ENV = "RTO_TEST_TWILIO_TOKEN"
PLIVO_ENV = "RTO_TEST_PLIVO_TOKEN"


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


def test_twilio_signs_a_stream_upgrade_over_its_wss_url() -> None:
    """The value is `printf %s URL | openssl dgst -sha1 -hmac twilio-auth-token -binary | base64`:
    an upgrade has no form fields, so the URL alone is signed."""
    url = "wss://voice.example.com/v1/phone/twilio"
    signed = "vFvCFLzEiBbdwgFjZ/q2aax8NCA="
    assert twilio_signature("twilio-auth-token", url, {}) == signed
    assert twilio_signature_ok("twilio-auth-token", url, {}, signed)
    # the number's URL may have been written with the default port, or the server see it so
    assert twilio_signature_ok("twilio-auth-token", url.replace(".com", ".com:443"), {}, signed)
    assert not twilio_signature_ok("twilio-auth-token", url.replace("wss", "https"), {}, signed)
    assert not twilio_signature_ok("another-token", url, {}, signed)
    assert not twilio_signature_ok("twilio-auth-token", url, {}, None)


def test_the_plivo_signature_is_plivos() -> None:
    """X-Plivo-Signature-V3 on a GET, computed from Plivo's description rather than by the code
    under test: `printf %s 'URL-with-its-query-sorted.NONCE' | openssl dgst -sha256 -hmac
    plivo-auth-token -binary | base64`."""
    url = "wss://voice.example.com/v1/phone/plivo?b=3&a=1&b=2"
    nonce = "0123456789"
    signed = "SM+kM1zDotxgSonZ8IRNrb+5/d1cgWandb2jsBPyw5A="  # over ...plivo?a=1&b=2&b=3.0123456789
    as_https = "Dv9ynCp+J7olyk+zgF1EOyPtEXQWOe6X0P0dy0MWSYo="  # the same URL spelt https://
    assert plivo_signature("plivo-auth-token", url, nonce) == signed
    assert plivo_signature_ok("plivo-auth-token", url, nonce, [signed])
    assert plivo_signature_ok("plivo-auth-token", url, nonce, [as_https])  # Plivo's SDKs' spelling
    # while a token rotates Plivo sends a comma-separated list
    assert plivo_signature_ok("plivo-auth-token", url, nonce, [f"bm90LXRoaXMtb25l, {signed}"])
    assert not plivo_signature_ok("plivo-auth-token", url, "9876543210", [signed])
    assert not plivo_signature_ok("plivo-auth-token", url, None, [signed])
    assert not plivo_signature_ok("another-token", url, nonce, [signed])
    assert not plivo_signature_ok("plivo-auth-token", url.replace("b=2", "b=4"), nonce, [signed])
    assert not plivo_signature_ok("plivo-auth-token", url, nonce, [])


def test_stream_upgrades_need_the_providers_signature() -> None:
    """With the accounts' tokens set, a Twilio or Plivo stream whose upgrade is unsigned, signed
    with another token or over another URL is refused before it is accepted; Telnyx, which signs
    no upgrade, is let in as before."""
    env = {TOKEN_ENV: "twilio-auth-token", PLIVO_ENV: "plivo-auth-token"}
    phone = {"twilio_auth_token_env": TOKEN_ENV, "plivo_auth_token_env": PLIVO_ENV}
    with gateway_server(env=env, phone=phone) as srv:
        ws_url = f"ws://127.0.0.1:{srv.port}/v1/phone/twilio"
        assert refused(srv, "/v1/phone/twilio", {}) == 403
        forged = {"X-Twilio-Signature": twilio_signature("another-token", ws_url, {})}
        assert refused(srv, "/v1/phone/twilio", forged) == 403
        good = {"X-Twilio-Signature": twilio_signature("twilio-auth-token", ws_url, {})}
        assert refused(srv, "/v1/phone/twilio", good) == 0
        # behind a TLS proxy on this host the URL Twilio connected to, and signed, is wss://
        # (uvicorn takes X-Forwarded-Proto from FORWARDED_ALLOW_IPS, 127.0.0.1 by default)
        tls = {**good, "X-Forwarded-Proto": "https"}
        assert refused(srv, "/v1/phone/twilio", tls) == 403
        wss_url = ws_url.replace("ws://", "wss://")
        tls["X-Twilio-Signature"] = twilio_signature("twilio-auth-token", wss_url, {})
        assert refused(srv, "/v1/phone/twilio", tls) == 0

        path = "/v1/phone/plivo?from=%2B15550100"
        url = f"ws://127.0.0.1:{srv.port}{path}"
        nonce = {"X-Plivo-Signature-V3-Nonce": "13579"}
        assert refused(srv, path, nonce) == 403
        forged = {**nonce, "X-Plivo-Signature-V3": plivo_signature("another-token", url, "13579")}
        assert refused(srv, path, forged) == 403
        good = {**nonce, "X-Plivo-Signature-V3": plivo_signature("plivo-auth-token", url, "13579")}
        assert refused(srv, path, good) == 0
        assert refused(srv, path, good) == 403  # the same nonce again: a replay
        assert refused(srv, path, {**good, "X-Plivo-Signature-V3-Nonce": "24680"}) == 403

        assert refused(srv, "/v1/phone/telnyx", {}) == 0


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


def test_a_bad_host_is_refused_and_a_refusal_logs_no_key(caplog: pytest.LogCaptureFixture) -> None:
    env = {TOKEN_ENV: "twilio-auth-token"}
    with gateway_server(keys=KEY, env=env, phone={"twilio_auth_token_env": TOKEN_ENV}) as srv:
        path = f"/v1/phone/twilio/voice?token={KEY}"
        kind = {"Content-Type": "application/x-www-form-urlencoded", "X-Twilio-Signature": "x"}
        for host in ("localhost:99999", "[::1", "localhost:port"):  # a 500 and a traceback
            status, _, _ = srv.request("POST", path, b"CallSid=1", {**kind, "Host": host})
            assert status in (400, 403)  # 400: the server's HTTP parser refused the host
        # a stream upgrade is refused as well, and neither log holds the key
        ws_headers = {"X-Twilio-Signature": "x"}
        assert refused(srv, f"/v1/phone/twilio?a=1&token={KEY}", ws_headers) == 403
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("realtime"))
    assert "does not match" in logged and KEY not in logged and "a=1&token=<hidden>" in logged


def test_a_call_id_reaches_the_log_escaped(caplog: pytest.LogCaptureFixture) -> None:
    forged = json.loads(start("not-a-token"))
    forged["start"]["callSid"] = "CA1\nERROR forged line"
    with gateway_server(keys=KEY) as srv, srv.websocket("/v1/phone/twilio") as ws:
        ws.send(json.dumps(forged))
        with pytest.raises(websockets.ConnectionClosed):
            ws.recv(timeout=timeout(5))
    assert "refused" in caplog.text and "\nERROR forged line" not in caplog.text


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


def test_streams_without_a_credential_never_crowd_out_those_with_one() -> None:
    config = PhoneConfig(max_pending_streams=3, max_pending_streams_per_address=2)
    anon = [(False, "198.51.100.7")] * 2 + [(False, "203.0.113.9")]
    assert pending_refusal(anon, (True, "192.0.2.1"), config) is None  # a key's stream
    assert pending_refusal(anon, (False, "192.0.2.1"), config) is not None  # 3 without
    assert pending_refusal(anon[:2], (False, "198.51.100.7"), config) is not None  # 2 from one
    assert pending_refusal(anon[:2], (False, "203.0.113.9"), config) is None
    keyed = [(True, "192.0.2.1")] * 3
    assert pending_refusal(keyed, (True, "192.0.2.2"), config) is not None
    assert pending_refusal(keyed, (False, "192.0.2.2"), config) is None


def test_idle_sockets_without_a_token_block_no_stream_that_shows_one() -> None:
    with gateway_server(keys=KEY, phone={"max_pending_streams": 2}) as srv:
        # Telnyx and Plivo carry their token in the URL: none, no deferral, refused at once.
        assert refused(srv, "/v1/phone/telnyx", {}) == 403
        assert refused(srv, "/v1/phone/plivo", {}) == 403
        idle = [srv.websocket("/v1/phone/twilio") for _ in range(2)]  # token due in `start`
        assert refused(srv, "/v1/phone/twilio", {}) == 403  # their budget is spent
        assert refused(srv, f"/v1/phone/telnyx?token={KEY}", {}) == 0  # not this one's
        assert refused(srv, "/v1/phone/twilio", bearer(KEY)) == 0
        for ws in idle:
            ws.close()
    phone = {"max_pending_streams_per_address": 1}
    with gateway_server(keys=KEY, phone=phone) as srv, srv.websocket("/v1/phone/twilio"):
        assert refused(srv, "/v1/phone/twilio", {}) == 403  # one address: one at a time
        assert refused(srv, f"/v1/phone/plivo?token={KEY}", {}) == 0


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


def test_behind_a_trusted_proxy_the_signed_url_is_the_proxys() -> None:
    """With `trust_forwarded_headers` the URL Twilio connected to, and signed, is the proxy's
    (wss://, its X-Forwarded-Host); without, a forwarded host cannot borrow a signature made
    for another server's URL."""
    env = {TOKEN_ENV: "twilio-auth-token"}
    elsewhere = "wss://other.example.com/v1/phone/twilio"
    borrowed = {
        "X-Twilio-Signature": twilio_signature("twilio-auth-token", elsewhere, {}),
        "X-Forwarded-Proto": "https",
        "X-Forwarded-Host": "other.example.com",
    }
    phone = {"twilio_auth_token_env": TOKEN_ENV}
    with gateway_server(env=env, phone=phone) as srv:
        assert refused(srv, "/v1/phone/twilio", borrowed) == 403
    with gateway_server(env=env, phone={**phone, "trust_forwarded_headers": True}) as srv:
        assert refused(srv, "/v1/phone/twilio", borrowed) == 0


def test_a_signed_webhook_replayed_is_refused() -> None:
    """A captured voice webhook, sent again, would mint another stream secret: refused."""
    env = {TOKEN_ENV: "twilio-auth-token"}
    with gateway_server(keys=KEY, env=env, phone={"twilio_auth_token_env": TOKEN_ENV}) as srv:
        path = f"/v1/phone/twilio/voice?token={KEY}"
        body = b"CallSid=CA7&From=%2B15550100&To=%2B15550199"
        url = f"http://127.0.0.1:{srv.port}{path}"
        signed = {
            "Content-Type": "application/x-www-form-urlencoded",
            "X-Twilio-Signature": twilio_signature(
                "twilio-auth-token", url, parse_qs(body.decode())
            ),
        }
        assert srv.request("POST", path, body, signed)[0] == 200
        assert srv.request("POST", path, body, signed)[0] == 403


def test_replays_are_remembered_for_the_window_and_forgotten_after() -> None:
    now = [0.0]
    seen = Replays(600, clock=lambda: now[0])
    assert seen.fresh("a") and not seen.fresh("a")
    now[0] = 601
    assert seen.fresh("a")  # past the window: a provider may sign the same again
