"""OpenAI's Live API over WebRTC (`POST /v1/live/sessions` with an SDP offer, the openai SDK's
`client.live.create` shape) against `realtime-omni serve` (the simulated config, whose vocoder
speaks a quiet tone) with a real aiortc caller on the loopback: audio on the tracks, the Live
events on the "oai-events" data channel."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from websockets.sync.client import connect as ws_connect

from realtime_omni.clients.webrtc import Caller, http
from realtime_omni.gateway.media.audio import resample
from tests.conftest import run, timeout
from tests.e2e.conftest import serving
from tests.e2e.test_webrtc import LOUD, settle

START = {"model": "qwen3-omni", "instructions": "Answer briefly."}


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with serving("--max-sessions", "2", "--ice-host-address", "127.0.0.1") as url:
        yield url


@pytest.fixture(scope="module")
def speech48(speech: np.ndarray) -> np.ndarray:
    return resample(speech, 24000, 48000)


def _post(url: str, body: Any) -> tuple[int, dict[str, Any]]:
    status, _, reply = http(
        "POST", f"{url}/v1/live/sessions", json.dumps(body).encode(), "application/json"
    )
    return status, json.loads(reply)


def test_speech_in_answer_out_and_close(server: str, speech48: np.ndarray) -> None:
    async def body() -> None:
        caller = Caller(server)
        await caller.connect(live=START, limit_s=timeout(10))
        try:
            assert caller.session_id and caller.session_id.startswith("sess_")
            _, started = await caller.wait_for("session.started", timeout(5))
            assert started is caller.events[0][1], "session.started comes first"
            assert started["session"]["id"] == caller.session_id
            assert started["session"]["instructions"] == START["instructions"]
            silence = np.zeros(48000, np.float32)
            caller.mic.say(np.concatenate([silence[:9600], speech48, silence]))
            _, heard = await caller.wait_for("session.input_transcript.delta", timeout(20))
            assert heard["delta"] and 0 <= heard["start_ms"] < heard["end_ms"], heard
            _, said = await caller.wait_for("session.output_transcript.delta", timeout(20))
            assert said["delta"] and said["end_ms"] >= said["start_ms"] > 0, said
            await caller.wait_for("session.usage.updated", timeout(20))  # the answer's end
            loud = [t for t, peak in caller.frames if peak > LOUD]
            assert len(loud) >= 10, len(loud)  # the answer's tone came on the track
            caller.send({"type": "session.close", "event_id": "close_1"})
            _, closed = await caller.wait_for("session.closed", timeout(10))
            assert closed["reason"] == "close_requested", closed
            # Always "active", as OpenAI's: the event says it closed; it says when it would expire.
            assert closed["session"]["status"] == "active" and closed["usage"]["seconds"] > 0
            assert closed["session"]["expires_at"] > time.time() + 3000
            kinds = [ev["type"] for _, ev in caller.events]
            assert "error" not in kinds, [ev for _, ev in caller.events if ev["type"] == "error"]
            assert "session.output_audio.delta" not in kinds  # audio goes on the track
            assert not any(k.startswith("output_audio_buffer.") for k in kinds)
            assert kinds.count("session.closed") == 1 and kinds[-1] == "session.closed"
            assert all("event_id" in ev for _, ev in caller.events)
            st = await settle(server)  # the server ended the call after session.closed
            assert st["sessions"] == 0 and st["webrtc"]["live"] == 0, st
        finally:
            await caller.hang_up()

    run(body(), 60)


def test_remote_hangup_told_to_the_sideband(server: str) -> None:
    async def body() -> None:
        caller = Caller(server)
        await caller.connect(live=START, limit_s=timeout(10))
        sid = caller.session_id
        ws_url = server.replace("http://", "ws://") + f"/v1/live/sessions/{sid}/attach"

        def sideband() -> list[dict[str, Any]]:
            got = []
            with ws_connect(ws_url, open_timeout=10) as ws:
                while True:
                    ev = json.loads(ws.recv(timeout=timeout(15)))
                    got.append(ev)
                    if ev["type"] == "session.closed":
                        return got

        watcher = asyncio.ensure_future(asyncio.to_thread(sideband))
        await caller.wait_for("session.started", timeout(5))
        await asyncio.sleep(0.5)  # the sideband attached
        await caller.hang_up()  # the peer connection closes: DTLS close_notify, no session.close
        events = await asyncio.wait_for(watcher, timeout(20))
        assert events[0]["type"] == "session.updated"
        assert events[-1]["reason"] == "remote_hangup", events[-1]
        st = await settle(server)
        assert st["sessions"] == 0 and st["webrtc"]["live"] == 0, st

    run(body(), 60)


def test_hangup_route_and_refusals(server: str) -> None:
    async def body() -> None:
        caller = Caller(server)
        await caller.connect(live=START, limit_s=timeout(10))
        try:
            await caller.wait_for("session.started", timeout(5))
            status, _, _ = await asyncio.to_thread(
                http, "POST", f"{server}/v1/live/sessions/{caller.session_id}/hangup"
            )
            assert status == 200
            _, closed = await caller.wait_for("session.closed", timeout(5))
            assert closed["reason"] == "close_requested"
            status, _, _ = await asyncio.to_thread(
                http, "POST", f"{server}/v1/live/sessions/{caller.session_id}/hangup"
            )
            assert status == 404
        finally:
            await caller.hang_up()
        offerer = Caller(server)
        sdp = await offerer.offer()
        await offerer.pc.close()
        for session, param in [
            ({**START, "wake_policy": {"type": "speech"}}, "session.wake_policy"),
            ({**START, "delegation": {"type": "responses"}}, "session.delegation.type"),
            ({**START, "audio": {"format": {"type": "audio/pcm"}}}, "session.audio.format"),
            ({"instructions": "no model"}, "session.model"),
        ]:
            body = {"session": session, "transport": {"type": "webrtc", "sdp": sdp}}
            status, reply = await asyncio.to_thread(_post, server, body)
            assert status == 400 and reply["error"]["param"] == param, reply
        status, reply = await asyncio.to_thread(_post, server, {"session": START})
        assert status == 400 and reply["error"]["param"] == "transport.type", reply
        st = await settle(server)
        assert st["sessions"] == 0 and st["webrtc"]["live"] == 0, st

    run(body(), 60)


def test_a_live_session_ends_expired_at_its_expires_at(tmp_path: Any) -> None:
    """`realtime.live_max_session_s`: the session resource says when it expires, and then it
    ends with `session.closed` reason `expired`."""
    import yaml

    from tests.conftest import ROOT

    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["realtime"] = {**cfg.get("realtime", {}), "live_max_session_s": 2.0}
    path = tmp_path / "short.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with serving(config=path) as url:
        ws_url = url.replace("http://", "ws://") + "/v1/live/sessions"
        with ws_connect(ws_url, open_timeout=10) as ws:
            ws.send(json.dumps({"type": "session.start", "session": START}))
            started = json.loads(ws.recv(timeout=timeout(10)))
            assert started["type"] == "session.started"
            assert 0 < started["session"]["expires_at"] - time.time() <= 2.5
            while (ev := json.loads(ws.recv(timeout=timeout(10))))["type"] != "session.closed":
                pass
            assert ev["reason"] == "expired"
