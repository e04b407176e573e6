"""SIGTERM drains: `/readyz` turns 503 at once, new sessions are refused with a clear error, a
live call goes on to its end, then the process exits; a call that outlives `--drain-s` is ended
at the deadline; a WebRTC call whose peer vanished does not hold the drain."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import pytest
import websockets

from realtime_omni.clients.webrtc import Caller
from tests.conftest import ROOT, free_port, run, timeout
from tests.e2e.test_realtime_ws import connect, send_audio, short_answers, until


def start(*args: str) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "realtime_omni.cli", "serve", "--port", str(port),
           "--config", str(ROOT / "configs" / "simulated-qwen3-omni.yaml"), *args]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout(60)
    while "serving" not in (line := proc.stdout.readline()):
        if (not line and proc.poll() is not None) or time.monotonic() > deadline:
            pytest.fail("the server did not start")
    return proc, f"http://127.0.0.1:{port}"


def ready(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


async def refused(url: str) -> dict[str, Any]:
    async with websockets.connect(url.replace("http", "ws") + "/v1/realtime") as ws:
        ev = json.loads(await asyncio.wait_for(ws.recv(), 10))
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 10)
        return {**ev["error"], "close": closed.value.rcvd.code if closed.value.rcvd else None}


def shm_left(pid: int) -> list[str]:
    return [p for p in os.listdir("/dev/shm") if p.startswith(f"rto_{pid}_")]


def test_sigterm_drains_a_live_call_to_its_end_then_exits(speech: np.ndarray) -> None:
    proc, url = start("--drain-s", "30")

    async def body() -> dict[str, Any]:
        async with connect(url) as conn:
            await until(conn, "session.created")
            await short_answers(conn)
            t_term = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            status, readyz = await asyncio.to_thread(ready, url)
            no = await refused(url)
            # the live call goes on: a whole turn, answered
            await send_audio(conn, np.concatenate([speech, np.zeros(24000, np.float32)]))
            done = await until(conn, "response.done", limit_s=20)
            assert proc.poll() is None, "the server left before its live call ended"
        t_hangup = time.monotonic()
        code = await asyncio.to_thread(proc.wait, timeout(20))
        return {"status": status, "readyz": readyz, "refused": no, "done": done,
                "exit_after_hangup_s": time.monotonic() - t_hangup, "code": code,
                "term_to_hangup_s": t_hangup - t_term}  # fmt: skip

    try:
        r = run(body(), limit_s=90)
    finally:
        proc.kill()
    want = {"ready": False, "draining": True, "degraded": False, "down": {}}
    assert r["status"] == 503 and r["readyz"] == want, r
    assert r["refused"]["code"] == "server_draining" and r["refused"]["close"] == 1013, r
    assert r["done"].response.status == "completed", r
    assert r["exit_after_hangup_s"] < 10, r  # once the last call ends, the process goes
    assert r["code"] in (0, -signal.SIGTERM), r
    assert shm_left(proc.pid) == []


def test_a_call_past_the_drain_deadline_is_ended_and_the_process_exits() -> None:
    proc, url = start("--drain-s", "2")

    async def body() -> tuple[float, int | None, float]:
        async with websockets.connect(url.replace("http", "ws") + "/v1/realtime") as ws:
            await ws.recv()  # session.created; then the caller just stays
            t_term = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            with pytest.raises(websockets.ConnectionClosed) as closed:
                while True:
                    await asyncio.wait_for(ws.recv(), 30)
            t_closed = time.monotonic() - t_term
        code = await asyncio.to_thread(proc.wait, timeout(20))
        return t_closed, closed.value.rcvd.code if closed.value.rcvd else None, code

    try:
        t_closed, close_code, code = run(body(), limit_s=90)
    finally:
        proc.kill()
    assert 1.8 < t_closed < 12, t_closed  # held to the deadline, not ended at once
    assert close_code == 1012, close_code  # "service restart": the server went away cleanly
    assert code in (0, -signal.SIGTERM)
    assert shm_left(proc.pid) == []


def vanish(caller: Caller) -> None:
    """The caller's machine drops off the network: its UDP sockets close under aiortc, so the
    server gets no DTLS close_notify, no SCTP ABORT, no hang-up, only silence."""
    ice = {t.sender.transport.transport for t in caller.pc.getTransceivers()}
    if caller.pc.sctp is not None:
        ice.add(caller.pc.sctp.transport.transport)
    for transport in ice:
        for protocol in transport._connection._protocols:
            protocol.transport.abort()


def live_sessions(url: str) -> int:
    with urllib.request.urlopen(f"{url}/healthz", timeout=5) as r:
        return int(json.loads(r.read())["sessions"])


def test_a_webrtc_peer_that_vanished_does_not_hold_the_drain() -> None:
    """Before, a server whose WebRTC peer had vanished without hanging up waited out the drain
    (or ICE's ~30 s to declare the peer gone) on SIGTERM. A call whose audio stopped for
    `--drain-media-timeout-s` (3 s) now ends in a drain; one whose audio flows goes on."""
    proc, url = start("--drain-s", "20")

    async def body() -> dict[str, float]:
        gone, live = Caller(url), Caller(url)
        try:
            await gone.connect()
            await live.connect()
            await asyncio.sleep(0.3)  # audio flowing from both
            vanish(gone)
            t_term = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            deadline = t_term + timeout(10)
            while await asyncio.to_thread(live_sessions, url) > 1:
                assert time.monotonic() < deadline, "the vanished call still holds the drain"
                await asyncio.sleep(0.1)
            t_gone = time.monotonic() - t_term
            await asyncio.sleep(0.5)
            still = await asyncio.to_thread(live_sessions, url)
            assert proc.poll() is None, "the server left before its live call ended"
            await live.hang_up()
            t_hangup = time.monotonic()
            await asyncio.to_thread(proc.wait, timeout(10))
            return {"gone_s": t_gone, "still": still, "exit_s": time.monotonic() - t_hangup}
        finally:
            await gone.pc.close()
            await live.hang_up()

    try:
        r = run(body(), limit_s=60)
    finally:
        proc.kill()
    assert 2.5 < r["gone_s"] < 3 + timeout(2), r  # the audio's timeout, not ICE's or the drain's
    assert r["still"] == 1, r  # the call whose audio flows holds the drain
    assert r["exit_s"] < timeout(5), r
    assert shm_left(proc.pid) == []
