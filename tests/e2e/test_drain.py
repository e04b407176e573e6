"""SIGTERM drains: `/readyz` turns 503 at once, new sessions are refused with a clear error, a
live call goes on to its end, then the process exits; a call that outlives `--drain-s` is ended
at the deadline."""

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

from tests.conftest import ROOT, run, timeout
from tests.e2e.conftest import _free_port
from tests.e2e.test_realtime_ws import connect, send_audio, short_answers, until


def start(*args: str) -> tuple[subprocess.Popen[str], str]:
    port = _free_port()
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
    assert r["status"] == 503 and r["readyz"] == {"ready": False, "draining": True}, r
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
