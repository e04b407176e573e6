"""The gateway's whole Starlette app on uvicorn, in a thread of this process, around a fake
pipeline: every route, middleware and transport is the real one, reached over real sockets
(http.client, websockets' sync client); no stage process is started.

    with gateway_server(keys="sk-test") as srv:          # srv.gw: the Gateway
        status, headers, body = srv.request("GET", "/v1/stats", headers=bearer("sk-test"))
        with srv.websocket("/v1/realtime", bearer("sk-test")) as ws:
            ws.recv()
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn
import websockets
from websockets.sync.client import ClientConnection, connect

from realtime_omni.gateway.app import Gateway, create_app
from realtime_omni.gateway.config import GatewayConfig, PhoneConfig, RealtimeConfig
from realtime_omni.pipeline.config import load_config
from tests.conftest import ROOT, free_port, timeout
from tests.unit.gateway.fakes import FakeCoord

KEYS_ENV = "RTO_TEST_APP_KEYS"


class _Graph:
    def local_processes(self) -> list[str]:
        return []


class AppCoord(FakeCoord):
    """`FakeCoord` with what `/v1/stats`, `/readyz` and `/metrics` read of a Coordinator."""

    ready = True
    degraded: dict[str, str] = {}
    in_flight = 0
    epochs: dict[str, int] = {}
    graph = _Graph()

    async def stats(self) -> dict[str, Any]:
        return {}

    def pid_of(self, process: str) -> int | None:
        return None

    def spares_loaded(self) -> dict[str, bool]:
        return {}

    async def close(self) -> None:
        pass


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@dataclass
class Served:
    port: int
    app: Any

    @property
    def gw(self) -> Gateway:
        return self.app.state.gateway  # type: ignore[no-any-return]

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str | bytes] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        """One request on a new connection: (status, lower-case headers, body). `path` goes
        as given (percent-encode what is not ASCII); header values may be bytes."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout(10))
        try:
            conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            given = {k.lower(): v for k, v in (headers or {}).items()}
            given.setdefault("host", f"127.0.0.1:{self.port}")
            if body is not None:
                given.setdefault("content-length", str(len(body)))
            for k, v in given.items():
                conn.putheader(k, v)
            conn.endheaders(body)
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def post_json(
        self, path: str, data: Any, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        status, _, raw = self.request(
            "POST", path, json.dumps(data).encode(),
            {"content-type": "application/json", **(headers or {})},
        )  # fmt: skip
        return status, json.loads(raw) if raw.startswith(b"{") else raw

    def websocket(
        self, path: str, headers: dict[str, str] | None = None, host: str | None = None
    ) -> ClientConnection:
        """A WebSocket client naming `host` (default the server's address) in its Host header;
        `websockets.InvalidStatus` when the server refuses it."""
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=timeout(10))
        return connect(
            f"ws://{host or f'127.0.0.1:{self.port}'}{path}",
            sock=sock,
            additional_headers=headers,
            open_timeout=timeout(10),
            close_timeout=1,
        )


def refused(srv: Served, path: str, headers: dict[str, str], host: str | None = None) -> int:
    """The HTTP status a WebSocket's upgrade got (0: it was accepted)."""
    try:
        with srv.websocket(path, headers, host):
            return 0
    except websockets.InvalidStatus as e:
        return int(e.response.status_code)


def recv_json(ws: ClientConnection) -> dict[str, Any]:
    return dict(json.loads(ws.recv(timeout=timeout(10))))


async def sdp_offer() -> str:
    """A browser-like offer (audio and the events channel) made by aiortc."""
    from aiortc import RTCPeerConnection
    from aiortc.mediastreams import AudioStreamTrack

    pc = RTCPeerConnection()
    try:
        pc.addTrack(AudioStreamTrack())
        pc.createDataChannel("oai-events")
        await pc.setLocalDescription(await pc.createOffer())
        return str(pc.localDescription.sdp)
    finally:
        await pc.close()


def offer() -> str:
    return asyncio.run(sdp_offer())


@contextlib.contextmanager
def gateway_server(
    keys: str = "",
    realtime: dict[str, Any] | None = None,
    phone: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    **config: Any,
) -> Iterator[Served]:
    """The app with `keys` (comma-separated; none: no authentication), the `realtime:` and
    `phone:` sections given and `GatewayConfig` fields, served on 127.0.0.1 for the block."""
    saved = {k: os.environ.get(k) for k in [KEYS_ENV, *(env or {})]}
    os.environ.update({KEYS_ENV: keys, **(env or {})})
    try:
        cfg = GatewayConfig(
            vad=False,
            ice_host_addresses=["127.0.0.1"],
            realtime=RealtimeConfig(api_keys_env=KEYS_ENV, **(realtime or {})),
            phone=PhoneConfig(**(phone or {})),
            **config,
        )
        pipeline = load_config(ROOT / "configs" / "simulated-qwen3-omni.yaml")
        app = create_app(pipeline, cfg, coordinator=AppCoord())
        port = free_port()
        server = uvicorn.Server(
            uvicorn.Config(
                # log_config None: uvicorn's loggers reach the root's, and pytest's caplog
                app, host="127.0.0.1", port=port, log_config=None,
                ws="websockets-sansio", lifespan="on",
            )
        )  # fmt: skip
        thread = threading.Thread(target=server.run, name="gateway-under-test", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout(20)
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the app did not start"
            time.sleep(0.01)
        try:
            yield Served(port, app)
        finally:
            server.should_exit = True
            thread.join(timeout(20))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def multipart(sdp: str, session: bytes, boundary: str = "b0undary") -> tuple[bytes, str]:
    """A POST /v1/realtime/calls body as OpenAI's clients send it: the offer and the session
    as form fields; and its content type."""
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="sdp"\r\n\r\n{sdp}\r\n'.encode(),
        f'--{boundary}\r\nContent-Disposition: form-data; name="session"\r\n\r\n'.encode()
        + session
        + b"\r\n",
        f"--{boundary}--\r\n".encode(),
    ]
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"
