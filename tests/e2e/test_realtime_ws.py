"""The official `openai` SDK's realtime client against `/v1/realtime`."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any

import numpy as np
import pytest
from openai import AsyncOpenAI

from realtime_omni.gateway.media.audio import float_to_pcm16
from tests.conftest import run, timeout
from tests.e2e.conftest import MAX_SESSIONS

CHUNK = 2400  # 100 ms at 24 kHz


def connect(url: str) -> Any:
    # A test leaves the server's later events unread; once its client's queue is full the
    # client reads nothing more, not the server's close frame either, and its close would wait
    # websockets' close_timeout (10 s) for it.
    client = AsyncOpenAI(api_key="x", base_url=f"{url}/v1")
    return client.realtime.connect(
        model="qwen3-omni", websocket_connection_options={"close_timeout": 1.0}
    )


async def send_audio(conn: Any, pcm: np.ndarray, pace_s: float = 0.0) -> None:
    for i in range(0, len(pcm), CHUNK):
        b64 = base64.b64encode(float_to_pcm16(pcm[i : i + CHUNK])).decode()
        await conn.send({"type": "input_audio_buffer.append", "audio": b64})
        if pace_s:
            await asyncio.sleep(pace_s)


async def until(conn: Any, kind: str, seen: list[Any] | None = None, limit_s: float = 15) -> Any:
    async def wait() -> Any:
        async for ev in conn:
            if seen is not None:
                seen.append((time.monotonic(), ev))
            if ev.type == kind:
                return ev
        raise AssertionError(f"connection closed before {kind}")

    return await asyncio.wait_for(wait(), timeout(limit_s))


async def short_answers(conn: Any, **session: Any) -> None:
    await conn.send(
        {
            "type": "session.update",
            "session": {"type": "realtime", "max_output_tokens": 6, **session},
        }
    )
    await until(conn, "session.updated")


def test_speech_in_audio_deltas_and_response_done_out(server: str, speech: np.ndarray) -> None:
    async def body() -> None:
        async with connect(server) as conn:
            assert (await until(conn, "session.created")).session.type == "realtime"
            await short_answers(conn)
            audio = np.concatenate(
                [np.zeros(4800, np.float32), speech, np.zeros(24000, np.float32)]
            )
            sender = asyncio.create_task(send_audio(conn, audio, pace_s=0.03))
            seen: list[Any] = []
            done = await until(conn, "response.done", seen)
            await sender
            kinds = [ev.type for _, ev in seen]
            for k in [
                "input_audio_buffer.speech_started",
                "input_audio_buffer.speech_stopped",
                "input_audio_buffer.committed",
                "conversation.item.added",
                "response.created",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_audio.delta",
                "response.output_item.done",
            ]:
                assert k in kinds, k
            assert kinds.index("response.output_audio.delta") < kinds.index("response.done")
            assert done.response.status == "completed"
            deltas = [ev for _, ev in seen if ev.type == "response.output_audio.delta"]
            pcm = b"".join(base64.b64decode(d.delta) for d in deltas)
            # 6 tokens x 2 frames x 1920 samples of 24 kHz pcm16, all of it, nothing else
            assert len(pcm) == 6 * 2 * 1920 * 2
            assert {d.response_id for d in deltas} == {done.response.id}
            stopped = next(t for t, ev in seen if ev.type == "input_audio_buffer.speech_stopped")
            first = next(t for t, ev in seen if ev.type == "response.output_audio.delta")
            print(f"speech_stopped -> first audio delta: {(first - stopped) * 1e3:.0f} ms")
            assert first - stopped < timeout(2.0)

    run(body())


def test_barge_in_cancels_with_turn_detected(server: str, speech: np.ndarray) -> None:
    async def body() -> None:
        async with connect(server) as conn:
            await short_answers(conn, max_output_tokens=40)  # ~6 s of answer
            turn = np.concatenate([speech, np.zeros(19200, np.float32)])
            await send_audio(conn, turn)
            seen: list[Any] = []
            await until(conn, "response.output_audio.delta", seen)
            await asyncio.sleep(0.5)
            # talk over the bot, well past min_interruption_ms
            await send_audio(conn, np.concatenate([speech, speech]))
            started = await until(conn, "input_audio_buffer.speech_started", seen)
            t_started = time.monotonic()
            done = await until(conn, "response.done", seen)
            assert done.response.status == "cancelled"
            assert done.response.status_details.reason == "turn_detected"
            late = [
                t for t, ev in seen if ev.type == "response.output_audio.delta" and t > t_started
            ]
            print(f"audio deltas after speech_started: {len(late)}")
            assert len(late) <= 1  # at most one already on the wire
            assert started.item_id

    run(body())


def test_push_to_talk_cancel_mid_response_and_g711(server: str) -> None:
    async def body() -> None:
        async with connect(server) as conn:
            await short_answers(
                conn,
                max_output_tokens=40,
                audio={
                    "input": {"turn_detection": None},
                    "output": {"format": {"type": "audio/pcmu"}},
                },
            )
            await send_audio(conn, np.zeros(4800, np.float32))
            await conn.send({"type": "input_audio_buffer.commit"})
            await until(conn, "input_audio_buffer.committed")
            await conn.send({"type": "response.create"})
            seen: list[Any] = []
            delta = await until(conn, "response.output_audio.delta", seen)
            assert len(base64.b64decode(delta.delta)) > 0
            await conn.send({"type": "response.create"})
            err = await until(conn, "error", seen)
            assert err.error.code == "conversation_already_has_active_response"
            await conn.send({"type": "response.cancel"})
            done = await until(conn, "response.done", seen)
            assert done.response.status == "cancelled"
            assert done.response.status_details.reason == "client_cancelled"
            audio_bytes = sum(
                len(base64.b64decode(ev.delta))
                for _, ev in seen
                if ev.type == "response.output_audio.delta"
            )
            assert audio_bytes < 40 * 2 * 640  # mu-law 8 kHz: 640 bytes per 80 ms frame
            await conn.send({"type": "response.cancel"})
            err = await until(conn, "error")
            assert err.error.code == "response_cancel_not_active"
            # the session goes on: a new answer, with context
            await conn.send({"type": "response.create", "response": {"max_output_tokens": 2}})
            assert (await until(conn, "response.done")).response.status == "completed"

    run(body())


def test_malformed_events_get_errors_and_the_connection_lives(server: str) -> None:
    async def body() -> None:
        async with connect(server) as conn:
            await until(conn, "session.created")
            for raw in [
                "not json",
                json.dumps({"type": "no.such.event", "event_id": "e1"}),
                json.dumps({"type": "session.update", "session": {"temperature": "x"}}),
                json.dumps([1, 2]),
                # wrong types deep in a session, deep nesting, a string that is not text
                json.dumps({"type": "session.update", "session": {"audio": {"input": "x"}}}),
                '{"type": "session.update", "session": ' + "[" * 5000 + "]" * 5000 + "}",
                json.dumps({"type": "session.update", "session": {"instructions": "\ud800"}}),
            ]:
                await conn.send_raw(raw)
                err = await until(conn, "error")
                assert err.error.message and err.error.type == "invalid_request_error", raw[:80]
                assert "Error(" not in err.error.message and "Traceback" not in err.error.message
            big = json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (9 << 20)})
            await conn.send_raw(big)
            assert (await until(conn, "error")).error.code == "message_too_large"
            await conn.send(
                {
                    "type": "session.update",
                    "session": {"type": "realtime", "instructions": "still here"},
                }
            )
            upd = await until(conn, "session.updated")
            assert upd.session.instructions == "still here"

    run(body())


def test_too_many_sessions_are_refused(server: str) -> None:
    async def body() -> None:
        conns = [connect(server) for _ in range(MAX_SESSIONS + 1)]
        opened = [await c.__aenter__() for c in conns[:MAX_SESSIONS]]
        for c in opened:
            await until(c, "session.created")
        extra = await conns[-1].__aenter__()
        err = await until(extra, "error")
        assert err.error.code == "too_many_sessions"
        await conns[-1].__aexit__(None, None, None)
        for c in conns[:MAX_SESSIONS]:
            await c.__aexit__(None, None, None)

    run(body())


@pytest.mark.parametrize("beta", [True])
def test_beta_clients_get_beta_names(server: str, beta: bool) -> None:
    async def body() -> None:
        client = AsyncOpenAI(api_key="x", base_url=f"{server}/v1")
        async with client.realtime.connect(
            model="qwen3-omni", extra_headers={"OpenAI-Beta": "realtime=v1"}
        ) as conn:
            created = json.loads(await conn.recv_bytes())
            assert created["type"] == "session.created"
            assert created["session"]["input_audio_format"] == "pcm16"
            await conn.send_raw(
                json.dumps(
                    {
                        "type": "session.update",
                        "session": {"turn_detection": None, "max_response_output_tokens": 2},
                    }
                )
            )
            await conn.send_raw(json.dumps({"type": "response.create"}))
            kinds = []
            while "response.done" not in kinds:
                kinds.append(
                    json.loads(await asyncio.wait_for(conn.recv_bytes(), timeout(10)))["type"]
                )
            assert "response.audio.delta" in kinds and "response.output_audio.delta" not in kinds
            assert "conversation.item.created" in kinds and "conversation.item.done" not in kinds

    run(body())


def test_speech_is_made_no_further_ahead_than_the_lead_limit(server: str) -> None:
    """The simulated talker makes a frame (80 ms of speech) every 14 ms: unchecked, it would be
    ~40 s of speech ahead after 3 s. The session stops reading at its lead limit (2 s by
    default), the runtime's per-request credits hold code2wav and then the talker."""

    async def body() -> None:
        async with connect(server) as conn:
            t0 = await answer_without_speech(conn, tokens=400)
            await asyncio.sleep(3.0)
            frames = (await stats(server, since=t0))["steps_since"]["talker_ar"]
            elapsed = time.monotonic() - t0
            # Frames of 80 ms: played so far, the 2 s lead (25), 4 in flight to code2wav, up to
            # 4 buffered in it, 2 chunks of 4 for the listener, one chunk read past the lead,
            # the step in progress. Unchecked it would be elapsed / 14 ms, about 230.
            allowed = elapsed / 0.08 + 25 + 4 + 4 + 8 + 4 + 1
            assert 10 < frames <= allowed < elapsed / 0.014, (frames, allowed)
            await conn.send({"type": "response.cancel"})
            assert (await until(conn, "response.done")).response.status == "cancelled"

    run(body())


async def answer_without_speech(conn: Any, tokens: int) -> float:
    """Push-to-talk, a commit of silence, `response.create`; returns when audio flows. Gives
    the monotonic time just before the response was asked for."""
    await short_answers(conn, max_output_tokens=tokens, audio={"input": {"turn_detection": None}})
    await send_audio(conn, np.zeros(4800, np.float32))
    await conn.send({"type": "input_audio_buffer.commit"})
    await until(conn, "input_audio_buffer.committed")
    t0 = time.monotonic()
    await conn.send({"type": "response.create"})
    await until(conn, "response.output_audio.delta")
    return t0


async def stats(server: str, since: float | None = None) -> dict[str, Any]:
    """GET /v1/stats (with `steps_since` counted from `since`)."""
    import urllib.request

    url = f"{server}/v1/stats" + (f"?since={since}" if since is not None else "")

    def get() -> dict[str, Any]:
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.status == 200
            return json.loads(r.read())

    return await asyncio.to_thread(get)


def test_hanging_up_while_the_lead_limit_holds_outputs_leaks_nothing(server: str) -> None:
    """The pipeline finishes an answer while the session still holds its last outputs unread
    (the lead limit); the client leaves then. Those outputs' credits must come back."""

    async def poll(pred: Any, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout(15)
        while not pred(st := await stats(server)):
            assert time.monotonic() < deadline, f"{what}: {st}"
            await asyncio.sleep(0.02)
        return st

    async def body() -> None:
        async with connect(server) as conn:
            # 40 tokens, 6.4 s of speech: the session reaches its 2 s lead and the last outputs
            # wait in credits until it reads again.
            await answer_without_speech(conn, tokens=40)
            st = await poll(lambda st: st["in_flight"] == 0, "the pipeline finishing the answer")
            edge = "code2wav->client"
            assert st["free_slots"][edge] < st["total_slots"][edge], "nothing held: no test"
        await poll(
            lambda st: st["sessions"] == 0 and st["free_slots"] == st["total_slots"],
            "every slot back once the session closed",
        )

    run(body())


def test_the_server_and_its_stages_froze_what_start_up_made(server: str) -> None:
    """Modules and models stay out of the cyclic collector's full passes (a pass over them took
    0.2-0.4 s per process: a stall of every call's audio)."""
    frozen = run(stats(server))["gc_frozen"]
    assert "gateway" in frozen and len(frozen) > 1  # the gateway and every stage process
    assert all(n > 10_000 for n in frozen.values()), frozen
