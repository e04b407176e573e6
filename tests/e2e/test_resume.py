"""A dropped `/v1/realtime` connection resumed (`transports/resume.py`): a real server, a raw
WebSocket client whose TCP connection is cut mid-answer, and the token `session.created` gave."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from websockets.asyncio.client import ClientConnection, connect

from realtime_omni.gateway.media.audio import float_to_pcm16
from tests.conftest import ROOT, run, timeout
from tests.e2e.conftest import serving

WINDOW_S = 3.0
KEY, OTHER_KEY = "sk-resume-a", "sk-resume-b"
TOKENS = 40  # the answer's tokens: 2 frames of 1,920 samples each, 6.4 s at 24 kHz
ANSWER_SAMPLES = TOKENS * 2 * 1920


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = tmp_path_factory.mktemp("resume") / "config.yaml"
    base = (ROOT / "configs" / "simulated-qwen3-omni.yaml").read_text()
    config.write_text(f"{base}\nrealtime:\n  resume_window_s: {WINDOW_S}\n")
    env = {"REALTIME_OMNI_API_KEYS": f"{KEY},{OTHER_KEY}"}
    with serving("--max-sessions", "4", config=config, env=env) as url:
        yield url


def ws_url(server: str, **query: Any) -> str:
    q = "&".join(f"{k}={v}" for k, v in {"model": "qwen3-omni", **query}.items())
    return f"{server.replace('http', 'ws')}/v1/realtime?{q}"


def opened(server: str, key: str = KEY, **query: Any) -> Any:
    return connect(
        ws_url(server, **query),
        additional_headers={"Authorization": f"Bearer {key}"},
        close_timeout=1,
        max_size=None,
    )


async def until(ws: ClientConnection, kind: str, seen: list[dict[str, Any]]) -> dict[str, Any]:
    async def wait() -> dict[str, Any]:
        while True:
            ev = json.loads(await ws.recv())
            seen.append(ev)
            if ev["type"] == kind:
                return ev

    return await asyncio.wait_for(wait(), timeout(20))


def audio_of(seen: list[dict[str, Any]], item_id: str) -> int:
    """Samples of `item_id`'s audio among the events."""
    deltas = [e for e in seen if e["type"] == "response.output_audio.delta"]
    return sum(len(base64.b64decode(e["delta"])) // 2 for e in deltas if e["item_id"] == item_id)


async def stats(server: str) -> dict[str, Any]:
    def get() -> dict[str, Any]:
        req = urllib.request.Request(
            f"{server}/v1/stats", headers={"Authorization": f"Bearer {KEY}"}
        )
        with urllib.request.urlopen(req, timeout=timeout(10)) as r:
            return dict(json.loads(r.read()))

    return await asyncio.to_thread(get)


async def stats_when(
    server: str, holds: Callable[[dict[str, Any]], bool], what: str, within_s: float = 5
) -> dict[str, Any]:
    """`/v1/stats` polled until `holds` is true of it, failing after `within_s` (scaled)."""
    deadline = time.monotonic() + timeout(within_s)
    while not holds(st := await stats(server)):
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}: {st}"
        await asyncio.sleep(0.05)
    return st


def parked(st: dict[str, Any]) -> bool:
    return bool(st["sessions"] == 1 and st["sessions_waiting_resume"] == 1)


async def mid_answer(ws: ClientConnection, speech: np.ndarray) -> tuple[list[Any], str, str]:
    """Speak a turn and take about a second of its answer: (events, user item, answer item)."""
    seen: list[dict[str, Any]] = []
    update = {"type": "realtime", "max_output_tokens": TOKENS}
    await ws.send(json.dumps({"type": "session.update", "session": update}))
    await until(ws, "session.updated", seen)
    pcm = np.concatenate([speech, np.zeros(19200, np.float32)])
    for i in range(0, len(pcm), 2400):
        b64 = base64.b64encode(float_to_pcm16(pcm[i : i + 2400])).decode()
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64}))
    user = (await until(ws, "input_audio_buffer.committed", seen))["item_id"]
    answer = (await until(ws, "response.output_audio.delta", seen))["item_id"]
    while audio_of(seen, answer) < 24000:
        await until(ws, "response.output_audio.delta", seen)
    return seen, user, answer


def drop(ws: ClientConnection) -> None:
    """Cut the TCP connection: no close frame, as a phone losing its network."""
    ws.transport.abort()


def test_resume_continues_the_answer_from_the_playback_ack(server: str, speech: np.ndarray) -> None:
    async def body() -> None:
        async with opened(server) as ws:
            created = json.loads(await ws.recv())
            sid, token = created["session"]["id"], created["resume"]["token"]
            assert created["resume"] == {"token": token, "window_s": WINDOW_S, "resumed": False}
            seen, user, answer = await mid_answer(ws, speech)
            drop(ws)
        got = audio_of(seen, answer)
        heard_ms = got // 24 - 300  # the client played 300 ms less than it got
        await stats_when(server, parked, "the server sees the drop and parks the session")
        last = seen[-1]["event_id"]
        query = {"resume": token, "last_event_id": last, "item_id": answer}
        async with opened(server, **query, audio_end_ms=heard_ms) as ws:
            again = json.loads(await ws.recv())
            assert again["type"] == "session.created" and again["session"]["id"] == sid
            assert again["resume"]["resumed"] is True
            assert again["resume"]["token"] != token
            after: list[dict[str, Any]] = []
            done = await until(ws, "response.done", after)
            assert done["response"]["status"] == "completed"
            # Every sample of the answer, once: what was played before the drop, then the rest.
            assert heard_ms * 24 + audio_of(after, answer) == ANSWER_SAMPLES
            assert all(e["type"] != "session.created" for e in after)
            # The same conversation: the turn spoken before the drop is in it.
            retrieve = {"type": "conversation.item.retrieve", "item_id": user}
            await ws.send(json.dumps(retrieve))
            item = await until(ws, "conversation.item.retrieved", after)
            assert item["item"]["id"] == user
            st = await stats(server)
            assert st["sessions"] == 1 and st["sessions_waiting_resume"] == 0
        # a clean close: no waiting for a resume
        await stats_when(server, lambda st: st["sessions"] == 0, "the closed session ends", 2)

    run(body(), 90)


def test_resume_cuts_the_answer_at_the_ack(server: str, speech: np.ndarray) -> None:
    async def body() -> None:
        async with opened(server) as ws:
            token = json.loads(await ws.recv())["resume"]["token"]
            seen, _, answer = await mid_answer(ws, speech)
            drop(ws)
        heard_ms = audio_of(seen, answer) // 24 - 100
        query = {"resume": token, "item_id": answer, "audio_end_ms": heard_ms, "answer": "cut"}
        async with opened(server, **query) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            after: list[dict[str, Any]] = []
            done = await until(ws, "response.done", after)
            assert done["response"]["status"] == "cancelled"
            truncated = [e for e in after if e["type"] == "conversation.item.truncated"]
            if truncated[-1:] == [] or truncated[-1]["audio_end_ms"] != heard_ms:
                cut = await until(ws, "conversation.item.truncated", after)
                assert cut["audio_end_ms"] == heard_ms
            assert audio_of(after, answer) == 0

    run(body(), 90)


def test_nobody_comes_back_the_session_ends_and_leaves_nothing(
    server: str, speech: np.ndarray
) -> None:
    async def body() -> None:
        async with opened(server) as ws:
            token = json.loads(await ws.recv())["resume"]["token"]
            await mid_answer(ws, speech)
            drop(ws)
        await stats_when(server, parked, "the server sees the drop and parks the session")
        # The window's end lets go of the session at once (it no longer counts against the
        # limits) and releases it in the background: aborting its answer in every stage takes a
        # moment more. Gone is when neither count holds it.
        t0 = time.monotonic()
        while (
            (st := await stats(server))["sessions"] or st["sessions_ending"]
        ) and time.monotonic() - t0 < WINDOW_S + 5:
            await asyncio.sleep(0.2)
        assert st["sessions"] == 0 and st["sessions_waiting_resume"] == 0
        assert st["sessions_ending"] == 0
        assert st["in_flight"] == 0 and not any(st["active_requests"].values()), st
        async with opened(server, resume=token) as ws:
            err = json.loads(await ws.recv())
            assert err["type"] == "error" and err["error"]["code"] == "resume_token_invalid"
            assert err["error"]["param"] == "resume"

    run(body(), 90)


def test_another_key_or_a_used_token_is_refused(server: str) -> None:
    async def body() -> None:
        async with opened(server) as ws:
            created = json.loads(await ws.recv())
            token = created["resume"]["token"]
            drop(ws)
        await stats_when(server, parked, "the server sees the drop and parks the session")
        async with opened(server, OTHER_KEY, resume=token) as ws:
            err = json.loads(await ws.recv())
            assert err["error"]["code"] == "resume_token_not_yours"
        async with opened(server, resume=token) as ws:
            assert json.loads(await ws.recv())["session"]["id"] == created["session"]["id"]
            async with opened(server, resume=token) as again:  # used
                err = json.loads(await again.recv())
                assert err["error"]["code"] == "resume_token_invalid"

    run(body(), 60)


def test_the_token_may_go_in_a_header_and_out_of_the_url(server: str) -> None:
    """No proxy's access log need keep it: `X-Resume-Token` resumes as `?resume=` does."""

    async def body() -> None:
        async with opened(server) as ws:
            created = json.loads(await ws.recv())
            drop(ws)
        await stats_when(server, parked, "the server sees the drop and parks the session")
        headers = {"Authorization": f"Bearer {KEY}", "X-Resume-Token": created["resume"]["token"]}
        async with connect(ws_url(server), additional_headers=headers, close_timeout=1) as ws:
            again = json.loads(await ws.recv())
            assert again["session"]["id"] == created["session"]["id"]
            assert again["resume"]["resumed"] is True

    run(body(), 60)


def test_a_clean_close_does_not_wait(server: str) -> None:
    async def body() -> None:
        async with opened(server) as ws:
            assert "resume" in json.loads(await ws.recv())
            assert (await stats(server))["sessions"] == 1
        st = await stats_when(server, lambda st: st["sessions"] == 0, "the closed session ends", 2)
        assert st["sessions_waiting_resume"] == 0

    run(body(), 30)
