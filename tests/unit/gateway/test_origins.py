"""The Host and Origin checks (`origins.py`): a web page the user visits, or a name rebound to
127.0.0.1, reaches nothing; plain clients (no Origin) and the server's own page do."""

from __future__ import annotations

import json

import pytest

from realtime_omni.gateway.origins import host_name
from tests.unit.gateway.app_harness import bearer, gateway_server, recv_json, refused

KEY = "sk-unit-0123"
APP = "https://app.example.com"


def test_host_names_lose_their_ports() -> None:
    assert host_name("127.0.0.1:8000") == "127.0.0.1"
    assert host_name("[::1]:8000") == "::1"
    assert host_name("::1") == "::1"
    assert host_name("Voice.Example.com.") == "voice.example.com"


@pytest.mark.parametrize("keys", ["", KEY])
def test_a_host_the_server_does_not_answer_to_is_refused(keys: str) -> None:
    auth = bearer(KEY) if keys else {}
    with gateway_server(keys=keys, realtime={"allowed_hosts": ["voice.example.com"]}) as srv:
        for host in ("evil.example:8000", "rebind.attacker.test", "10.0.0.7"):
            status, _, body = srv.request("GET", "/v1/stats", headers={**auth, "Host": host})
            assert status == 400 and json.loads(body)["error"]["code"] == "host_not_allowed"
            assert refused(srv, "/v1/realtime", auth, host) == 403
        for host in (f"127.0.0.1:{srv.port}", "localhost", "[::1]:80", "voice.example.com"):
            assert srv.request("GET", "/v1/stats", headers={**auth, "Host": host})[0] == 200
        assert srv.request("GET", "/healthz", headers={"Host": "evil.example"})[0] == 400


@pytest.mark.parametrize("keys", ["", KEY])
def test_a_websocket_or_post_from_another_origin_is_refused(keys: str) -> None:
    auth = bearer(KEY) if keys else {}
    with gateway_server(keys=keys, realtime={"cors_origins": [APP]}) as srv:
        own = f"http://127.0.0.1:{srv.port}"
        for origin in ("https://evil.example", "null", f"http://localhost:{srv.port}"):
            assert refused(srv, "/v1/realtime", {**auth, "Origin": origin}) == 403
            status, body = srv.post_json(
                "/v1/realtime/client_secrets", {}, {**auth, "Origin": origin}
            )
            assert status == 403 and body["error"]["code"] == "origin_not_allowed"
            # reading is not changing: a GET goes on (CORS keeps the page from reading it)
            assert srv.request("GET", "/v1/stats", headers={**auth, "Origin": origin})[0] == 200
        for origin in (own, APP, None):  # its own page, a configured origin, a plain client
            headers = {**auth, **({"Origin": origin} if origin else {})}
            with srv.websocket("/v1/realtime", headers) as ws:
                assert recv_json(ws)["type"] == "session.created"
            assert srv.post_json("/v1/realtime/client_secrets", {}, headers)[0] == 200
