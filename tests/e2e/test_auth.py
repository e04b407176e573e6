"""API keys, client secrets, OpenAI's `/v1/realtime/calls` and its sideband, CORS, against a
real `realtime-omni serve` started with keys in REALTIME_OMNI_API_KEYS."""

from __future__ import annotations

import asyncio
import json
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets
import yaml

from realtime_omni.clients.webrtc import Caller, http
from tests.conftest import ROOT, run, timeout
from tests.e2e.conftest import serving
from tests.e2e.test_webrtc import settle

KEY = "sk-test-0123456789"
ORIGIN = "https://app.example.com"


@pytest.fixture(scope="module")
def ipc_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(tmp_path_factory.mktemp("auth")) / "ipc"  # the server makes it


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, ipc_dir: Path) -> Iterator[str]:
    cfg = yaml.safe_load((ROOT / "configs" / "simulated-qwen3-omni.yaml").read_text())
    cfg["realtime"] = {"cors_origins": [ORIGIN], "api_keys_env": "TEST_KEYS"}
    cfg.setdefault("runtime", {})["ipc_dir"] = str(ipc_dir)
    path = Path(tmp_path_factory.mktemp("auth")) / "keys.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {"TEST_KEYS": f"other-key, {KEY}"}
    with serving("--ice-host-address", "127.0.0.1", config=path, env=env) as url:
        yield url


def get(url: str, token: str | None = None, **headers: str) -> tuple[int, dict[str, str], bytes]:
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return http("GET", url, headers=headers)


def mint(server: str, session: dict[str, Any], seconds: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"session": session}
    if seconds:
        body["expires_after"] = {"anchor": "created_at", "seconds": seconds}
    status, _, raw = http(
        "POST",
        f"{server}/v1/realtime/client_secrets",
        json.dumps(body).encode(),
        "application/json",
        {"Authorization": f"Bearer {KEY}"},
    )
    assert status == 200, raw
    return dict(json.loads(raw))


def ws_url(server: str, query: str = "") -> str:
    return server.replace("http://", "ws://") + "/v1/realtime" + query


async def first_event(ws: Any) -> dict[str, Any]:
    return dict(json.loads(await asyncio.wait_for(ws.recv(), timeout(10))))


def test_routes_need_a_key_but_health_and_the_page(server: str) -> None:
    assert get(f"{server}/healthz")[0] == 200
    assert get(f"{server}/")[0] == 200
    status, headers, body = get(f"{server}/v1/stats")
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert json.loads(body)["error"]["code"] == "invalid_api_key"
    assert get(f"{server}/v1/stats", "wrong")[0] == 401
    assert get(f"{server}/v1/stats", KEY)[0] == 200
    assert get(f"{server}/v1/stats", "other-key")[0] == 200  # each key of the list
    status, _, _ = http("POST", f"{server}/v1/whip", b"v=0", "application/sdp")
    assert status == 401


def test_the_stages_sockets_folder_is_for_the_servers_user_alone(
    server: str, ipc_dir: Path
) -> None:
    assert ipc_dir.is_dir() and stat.S_IMODE(ipc_dir.stat().st_mode) == 0o700
    assert any(p.is_socket() for p in ipc_dir.iterdir())  # the stages' ipc:// sockets


def test_websocket_keys_by_header_and_by_browser_subprotocol(server: str) -> None:
    async def body() -> None:
        with pytest.raises(websockets.InvalidStatus) as e:
            async with websockets.connect(ws_url(server)):
                pass
        assert e.value.response.status_code == 403
        headers = {"Authorization": f"Bearer {KEY}"}
        async with websockets.connect(ws_url(server), additional_headers=headers) as ws:
            assert (await first_event(ws))["type"] == "session.created"
        # what a browser sends: it cannot set headers
        protocols = ["realtime", f"openai-insecure-api-key.{KEY}"]
        async with websockets.connect(ws_url(server), subprotocols=protocols) as ws:  # type: ignore[arg-type]
            assert ws.subprotocol == "realtime"  # echoed, or the browser fails the handshake
            assert (await first_event(ws))["type"] == "session.created"

    run(body(), 30)


def test_a_client_secret_carries_its_session_and_expires(server: str) -> None:
    from openai.types.realtime import ClientSecretCreateResponse

    secret = mint(server, {"type": "realtime", "instructions": "Be brief."}, seconds=10)
    ClientSecretCreateResponse.model_validate(secret)  # the SDK's type for the answer
    assert secret["value"].startswith("ek_") and secret["expires_at"] > time.time()

    async def body() -> None:
        headers = {"Authorization": f"Bearer {secret['value']}"}
        async with websockets.connect(ws_url(server), additional_headers=headers) as ws:
            created = await first_event(ws)
            assert created["session"]["instructions"] == "Be brief."
        # a secret cannot mint more
        status, _, _ = http(
            "POST", f"{server}/v1/realtime/client_secrets", b"{}", "application/json", headers
        )
        assert status == 403
        await asyncio.sleep(max(0.0, secret["expires_at"] - time.time()) + 0.5)
        with pytest.raises(websockets.InvalidStatus):
            async with websockets.connect(ws_url(server), additional_headers=headers):
                pass

    run(body(), 40)
    # a secret asking for what the server cannot do is refused when minted, naming the field
    status, _, raw = http(
        "POST",
        f"{server}/v1/realtime/client_secrets",
        json.dumps({"session": {"audio": {"output": {"voice": "nobody"}}}}).encode(),
        "application/json",
        {"Authorization": f"Bearer {KEY}"},
    )
    assert status == 400 and b"session.audio.output.voice" in raw


def test_a_webrtc_call_by_openais_flow_with_its_sideband(server: str) -> None:
    async def body() -> None:
        secret = mint(server, {"instructions": "From the secret."})["value"]
        caller = Caller(server)
        await caller.connect(
            calls=True, token=secret, session={"audio": {"output": {"voice": "alloy"}}}
        )
        try:
            assert caller.location == f"/v1/realtime/calls/{caller.session_id}"
            _, created = await caller.wait_for("session.created", timeout(10))
            assert created["session"]["instructions"] == "From the secret."  # the secret's
            assert created["session"]["audio"]["output"]["voice"] == "alloy"  # and the call's
            headers = {"Authorization": f"Bearer {KEY}"}
            url = ws_url(server, f"?call_id={caller.session_id}")
            async with websockets.connect(url, additional_headers=headers) as side:
                first = await first_event(side)
                assert first["type"] == "session.updated"
                # the server side steers the call; the browser sees it happen
                t = time.monotonic()
                await side.send(
                    json.dumps({"type": "session.update", "session": {"instructions": "Hi."}})
                )
                got = await first_event(side)
                assert got["type"] == "session.updated"
                assert got["session"]["instructions"] == "Hi."
                _, seen = await caller.wait_for("session.updated", timeout(10), since=t)
                assert seen["session"]["instructions"] == "Hi."
                # hanging up ends the call, and its sideband with it
                status, _, _ = http(
                    "POST", f"{server}/v1/realtime/calls/{caller.session_id}/hangup", b"",
                    None, headers,
                )  # fmt: skip
                assert status == 200
                with pytest.raises(websockets.ConnectionClosed):
                    while True:
                        await asyncio.wait_for(side.recv(), timeout(10))
        finally:
            await caller.hang_up()
        st = await settle(server, headers={"Authorization": f"Bearer {KEY}"})
        assert st["sessions"] == 0

    run(body(), 60)


def test_cors_preflight_for_the_configured_origin_only(server: str) -> None:
    ask = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    ask["Access-Control-Request-Headers"] = "authorization, content-type"
    status, headers, _ = http("OPTIONS", f"{server}/v1/realtime/calls", headers=ask)
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in headers["access-control-allow-headers"].lower()
    status, headers, _ = http(
        "OPTIONS", f"{server}/v1/realtime/calls", headers={**ask, "Origin": "https://evil.test"}
    )
    assert status == 400 and "access-control-allow-origin" not in headers


def test_serving_the_network_without_keys_needs_a_flag() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "realtime_omni.cli", "serve", "--host", "0.0.0.0", "--port", "0",
         "--config", str(ROOT / "configs" / "simulated-qwen3-omni.yaml")],
        capture_output=True, text=True, timeout=timeout(60), cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
    )  # fmt: skip
    assert proc.returncode == 2
    assert "no authentication" in proc.stderr and "--allow-no-auth" in proc.stderr


def test_the_demo_page_calls_with_a_client_secret_and_is_refused_without(
    server: str, mic_wav: Path
) -> None:
    """The page's own flow: the secret an app's backend minted comes in its URL, the call goes
    to /v1/realtime/calls; no secret, or one expired, and the server refuses the call."""
    from playwright.sync_api import sync_playwright

    from tests.e2e.test_browser import CHROMIUM, chromium_flags

    if CHROMIUM is None:
        pytest.fail("chromium is not installed (apt-get install chromium; .ci/run does)")
    secret = mint(server, {"max_output_tokens": 8}, seconds=10)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=chromium_flags(mic_wav)
        )
        try:
            page = browser.new_page()
            page.goto(f"{server}/#client_secret={secret['value']}")
            page.click("#connect")
            page.wait_for_function(
                "window.omni.connected && (window.omni.events['response.done'] || 0) >= 1"
                " && window.omni.rx.maxPeak > 0.01",
                timeout=timeout(30) * 1000,
            )
            state = page.evaluate("window.omni")
            assert state["errors"] == [] and state["sessionId"].startswith("sess_"), state
            page.click("#connect")  # hang up

            def refused(url: str) -> list[str]:
                other = browser.new_page()
                other.goto(url)
                other.click("#connect")
                other.wait_for_function(
                    "window.omni.state === 'failed'", timeout=timeout(15) * 1000
                )
                return list(other.evaluate("window.omni.errors"))

            assert any("HTTP 401" in e for e in refused(server)), "a call without a secret"
            time.sleep(max(0.0, secret["expires_at"] - time.time()) + 0.5)
            late = refused(f"{server}/#client_secret={secret['value']}")
            assert any("HTTP 401" in e for e in late), "a call with an expired secret"
        finally:
            browser.close()
