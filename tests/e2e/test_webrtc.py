"""A real aiortc caller against `realtime-omni serve` (configs/simulated-qwen3-omni.yaml, whose
vocoder speaks a quiet tone) over WebRTC on the loopback."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from realtime_omni.clients.webrtc import Caller, http
from realtime_omni.gateway.media.audio import resample
from tests.conftest import run, timeout
from tests.e2e.conftest import serving

MAX_SESSIONS = 2
LOUD = 0.05  # the simulated tone peaks at 0.1; Opus leaves < 0.01 of it a frame after a cut
FRAME_S = 0.02


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    # loopback only: no ICE check goes to another interface
    with serving("--max-sessions", str(MAX_SESSIONS), "--ice-host-address", "127.0.0.1") as url:
        yield url


@pytest.fixture(scope="module")
def speech48(speech: np.ndarray) -> np.ndarray:
    return resample(speech, 24000, 48000)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format: `name{labels} value` lines, comments skipped."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def get_json(url: str, headers: dict[str, str] | None = None) -> Any:
    status, _, body = http("GET", url, headers=headers)
    assert status == 200, body
    return json.loads(body)


async def settle(
    url: str, limit_s: float = 5.0, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    """/v1/stats once no session is left and the pipeline holds nothing.

    Waits for the credits too: a stage's acknowledgement to the stage before it comes
    from another process than the stats answer does, so it can trail `in_flight` by a
    few milliseconds. A credit really lost is still out at the deadline."""
    deadline = time.monotonic() + timeout(limit_s)
    while True:
        st = await asyncio.to_thread(get_json, f"{url}/v1/stats", headers)
        idle = st["sessions"] == 0 and st["webrtc"]["live"] == 0 and pipeline_idle(st)
        if idle or time.monotonic() > deadline:
            return st
        await asyncio.sleep(0.05)


def pipeline_idle(st: dict[str, Any]) -> bool:
    return (
        st["in_flight"] == 0
        and st["free_slots"] == st["total_slots"]
        and not any(st["active_requests"].values())
    )


def assert_pipeline_idle(st: dict[str, Any]) -> None:
    assert st["in_flight"] == 0, st
    assert st["free_slots"] == st["total_slots"], st
    assert not any(st["active_requests"].values()), st


async def short_answers(caller: Caller, tokens: int) -> None:
    caller.send(
        {"type": "session.update", "session": {"type": "realtime", "max_output_tokens": tokens}}
    )
    await caller.wait_for("session.updated", timeout(10))


def test_speech_in_audio_back_and_events(server: str, speech48: np.ndarray) -> None:
    async def body() -> None:
        caller = Caller(server)
        await caller.connect(limit_s=timeout(10))
        try:
            assert caller.session_id and caller.session_id.startswith("sess_")
            _, created = await caller.wait_for("session.created", timeout(5))
            assert created is caller.events[0][1] and created["session"]["id"] == caller.session_id
            await short_answers(caller, 6)
            silence = np.zeros(48000, np.float32)
            caller.mic.say(np.concatenate([silence[:9600], speech48, silence]))
            _, done = await caller.wait_for("response.done", timeout(20))
            assert done["response"]["status"] == "completed"
            await caller.wait_for("output_audio_buffer.stopped", timeout(5))
            kinds = [ev["type"] for _, ev in caller.events]
            for k in [
                "input_audio_buffer.speech_started",
                "input_audio_buffer.speech_stopped",
                "input_audio_buffer.committed",
                "response.created",
                "output_audio_buffer.started",
            ]:
                assert k in kinds, k
            assert all("event_id" in ev for _, ev in caller.events)
            t_created, _ = await caller.wait_for("response.created")
            loud = [t for t, peak in caller.frames if peak > LOUD]
            # 6 tokens x 2 codec frames x 80 ms = 960 ms of tone: about 48 loud 20 ms frames
            assert 30 <= len(loud) <= 60, len(loud)
            assert loud[0] > t_created
            before = [p for t, p in caller.frames if t < t_created]
            assert before and max(before) < LOUD  # silence while nothing was said
            # Prometheus, scraped during the call: the histograms have the answer in them.
            status, headers, raw = await asyncio.to_thread(http, "GET", f"{server}/metrics")
            assert status == 200 and headers["content-type"].startswith("text/plain")
            metrics = parse_metrics(raw.decode())
            assert metrics["rto_session_first_audio_ms_count"] >= 1
            assert metrics["rto_session_token_to_audio_ms_count"] >= 1
            for stage in ("thinker", "talker_ar", "code2wav"):
                assert metrics[f'rto_stage_step_seconds_count{{stage="{stage}"}}'] > 0
                assert metrics[f'rto_stage_batch_size_count{{stage="{stage}"}}'] > 0
                cpu = metrics[f'rto_stage_step_cpu_seconds_total{{stage="{stage}"}}']
                assert 0 <= cpu <= metrics[f'rto_stage_step_seconds_sum{{stage="{stage}"}}']
            assert metrics['rto_sessions{transport="webrtc"}'] == 1
            assert 'rto_edge_slots_in_use{edge="thinker->talker_ar"}' in metrics
            assert 'rto_edge_queued{edge="talker_ar->code2wav",side="out"}' in metrics
            assert metrics["rto_webrtc_frames_total"] > 0
            assert (await asyncio.to_thread(http, "GET", f"{server}/readyz"))[0] == 200
        finally:
            await caller.hang_up()
        st = await settle(server)
        assert st["sessions"] == 0
        assert_pipeline_idle(st)
        assert st["webrtc"]["frames"] > 0

    run(body(), 60)


def test_barge_in_silences_the_track_and_every_stage_acks(
    server: str, speech48: np.ndarray
) -> None:
    async def body() -> None:
        caller = Caller(server)
        await caller.connect(limit_s=timeout(10))
        try:
            await short_answers(caller, 40)  # about 6 s of answer
            caller.mic.say(np.concatenate([speech48, np.zeros(24000, np.float32)]))
            t_audio, _ = await caller.wait_for("output_audio_buffer.started", timeout(20))
            # No new answer to the speech that comes: the pipeline must end up idle, not busy.
            td = {"type": "server_vad", "create_response": False}
            caller.send(
                {
                    "type": "session.update",
                    "session": {"type": "realtime", "audio": {"input": {"turn_detection": td}}},
                }
            )
            await caller.wait_for("session.updated", timeout(5), since=t_audio)
            await asyncio.sleep(0.6)
            t_talk = time.monotonic()
            caller.mic.say(speech48)  # talk over the bot
            t_started, _ = await caller.wait_for(
                "input_audio_buffer.speech_started", timeout(10), since=t_talk
            )
            _, done = await caller.wait_for("response.done", timeout(10), since=t_talk)
            assert done["response"]["status"] == "cancelled"
            assert done["response"]["status_details"]["reason"] == "turn_detected"
            await asyncio.sleep(0.5)
            frames = [(t, p) for t, p in caller.frames if t > t_audio]
            assert any(p > LOUD for t, p in frames if t < t_started)  # the bot was talking
            after = [p for t, p in frames if t > t_started]
            last_loud = max((i for i, p in enumerate(after) if p > LOUD), default=-1)
            print(f"loud frames received after speech_started: {last_loud + 1}")
            # The server's next frame is silent; what was already sent comes out of the
            # caller's jitter buffer (aiortc holds a few frames) and the wire.
            assert last_loud + 1 <= 12, [round(p, 3) for p in after[:20]]
            assert len(after) >= 20 and max(after[last_loud + 1 :]) < LOUD
            metrics = await asyncio.to_thread(get_json, f"{server}/v1/metrics")
            print(f"server: barge-in -> silence {metrics['barge_in_to_silence_ms']}")
            assert metrics["barge_in_to_silence_ms"]["n"] >= 1
            st = await asyncio.to_thread(get_json, f"{server}/v1/stats")
            assert st["sessions"] == 1
            assert_pipeline_idle(st)  # the abort reached every stage and freed every slot
        finally:
            await caller.hang_up()
        assert (await settle(server))["sessions"] == 0

    run(body(), 60)


def test_whip_create_and_delete(server: str) -> None:
    async def body() -> None:
        caller = Caller(server)
        await caller.connect(whip=True, limit_s=timeout(10))
        assert caller.location == f"/v1/whip/{caller.session_id}"
        await caller.wait_for("session.created", timeout(5))
        assert (await asyncio.to_thread(get_json, f"{server}/v1/stats"))["webrtc"]["live"] == 1
        location = caller.location
        await caller.hang_up()  # DELETE
        st = await settle(server)
        assert st["sessions"] == 0 and st["webrtc"]["live"] == 0
        status, _, _ = await asyncio.to_thread(http, "DELETE", f"{server}{location}")
        assert status == 404

    run(body(), 30)


def test_bad_offers_are_refused_and_leave_nothing(server: str) -> None:
    async def body() -> None:
        caller = Caller(server)
        sdp = await caller.offer()
        await caller.pc.close()
        offer_url, whip_url = f"{server}/v1/webrtc/offer", f"{server}/v1/whip"

        def post(url: str, body: bytes, kind: str = "application/json") -> tuple[int, Any]:
            status, _, raw = http("POST", url, body, kind)
            return status, json.loads(raw) if raw.startswith(b"{") else raw

        broken = sdp.replace("a=fingerprint:", "a=fingerprint-gone:")
        for url, payload, kind, want in [
            (offer_url, b"not json", "application/json", 400),
            (offer_url, json.dumps({"sdp": "hello", "type": "offer"}).encode(), None, 400),
            (offer_url, json.dumps({"sdp": sdp, "type": "answer"}).encode(), None, 400),
            (offer_url, json.dumps({"sdp": broken, "type": "offer"}).encode(), None, 400),
            (offer_url, json.dumps({"sdp": 5, "type": "offer"}).encode(), None, 400),
            (whip_url, b"v=0\r\nm=garbage\r\n", "application/sdp", 400),
            (whip_url, sdp.encode(), "text/plain", 415),
            (offer_url, b"x" * (300 << 10), None, 413),
        ]:
            status, reply = await asyncio.to_thread(post, url, payload, kind or "application/json")
            assert status == want, (payload[:60], status, reply)
            assert reply["error"]["message"], reply
        # At the limit, offers that never connect give their places to newer offers, oldest
        # first (before, they held them for 30 s each: a few POSTs locked every caller out).
        held = []
        for _ in range(MAX_SESSIONS + 2):
            status, headers, _ = await asyncio.to_thread(
                http, "POST", whip_url, sdp.encode(), "application/sdp"
            )
            assert status == 201
            held.append(headers["location"])
        for loc in held[:2]:  # the two oldest made room
            assert (await asyncio.to_thread(http, "DELETE", f"{server}{loc}"))[0] == 404
        for loc in held[2:]:
            assert (await asyncio.to_thread(http, "DELETE", f"{server}{loc}"))[0] == 200
        st = await settle(server)
        assert st["sessions"] == 0 and st["webrtc"]["live"] == 0
        assert_pipeline_idle(st)

    run(body(), 30)


def test_a_client_at_the_protocol_limits_does_not_hold_up_another_call(server: str) -> None:
    """While a WebRTC call plays, a WebSocket client sends a 6 MB input_audio_buffer.append
    and a 6000x6000 PNG: the call's output frames stay on time (before, the append alone
    stopped the whole server for 4.2 s, the image's decoding for 0.34 s, and inflating the
    compressed append for up to 0.38 s)."""
    import base64
    import io

    import websockets
    from PIL import Image

    y, x = np.mgrid[0:6000, 0:6000]
    img = np.stack([x % 256, y % 256, (x + y) % 256], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "PNG", compress_level=1)
    image = {"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64," + base64.b64encode(
            buf.getvalue()).decode()}]}  # fmt: skip
    pcm = (np.random.default_rng(0).standard_normal(3_000_000) * 3000).astype(np.int16)
    append = {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}
    messages = [json.dumps(append), json.dumps({"type": "conversation.item.create", "item": image})]
    assert all(len(m) < 8 << 20 for m in messages) and len(messages[0]) > 7_900_000

    async def body() -> None:
        caller = Caller(server)
        await caller.connect(limit_s=timeout(10))
        try:
            await caller.wait_for("session.created", timeout(5))
            await asyncio.sleep(0.5)  # the call's track runs
            before = (await asyncio.to_thread(get_json, f"{server}/v1/stats"))["webrtc"]
            url = server.replace("http://", "ws://") + "/v1/realtime"
            async with websockets.connect(url, max_size=None) as ws:
                # permessage-deflate, offered, is declined: inflating 8 MB held the loop 0.4 s
                assert not ws.protocol.extensions
                await ws.recv()  # session.created
                for msg in messages:
                    await ws.send(msg)
                while True:  # the image item is added once both were handled
                    ev = json.loads(await asyncio.wait_for(ws.recv(), timeout(20)))
                    assert ev["type"] != "error", ev
                    if ev["type"] == "conversation.item.added":
                        break
            await asyncio.sleep(0.5)
            after = (await asyncio.to_thread(get_json, f"{server}/v1/stats"))["webrtc"]
        finally:
            await caller.hang_up()
        frames = after["frames"] - before["frames"]
        late = after["frames_late"] - before["frames_late"]
        # DESIGN.md: a client at the protocol's limits makes no other call wait > 150 ms.
        assert frames > 40 and after["lateness_ms_max"] < 150, (frames, late, after)

    run(body(), 60)
