"""A transcription session (`/v1/realtime?intent=transcription`) driven by the official `openai`
SDK: each spoken turn comes back as transcription deltas and a completed transcript, nothing
answers, and no speech stage (talker, code2wav) does any work. The simulated thinker's words are
placeholders: the test checks the flow, not the words."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from openai import AsyncOpenAI

from tests.conftest import run, timeout
from tests.e2e.conftest import serving
from tests.e2e.test_realtime_ws import send_audio, until

SPEECH_STAGES = ("talker_ar", "code2wav")


@pytest.fixture(scope="module")
def own_server() -> Iterator[str]:
    """A server of its own: its stages' steps are this test's alone."""
    with serving() as url:
        yield url


def connect(url: str) -> Any:
    client = AsyncOpenAI(api_key="x", base_url=f"{url}/v1")
    return client.realtime.connect(
        extra_query={"intent": "transcription"},
        websocket_connection_options={"close_timeout": 1.0},
    )


def compute_ms(url: str) -> dict[str, dict[str, float]]:
    """The transcriptions' compute per stage (`transcription_compute_ms.<stage>`: n, sum)."""
    with urllib.request.urlopen(f"{url}/v1/metrics", timeout=timeout(10)) as r:
        metrics: dict[str, dict[str, float]] = json.load(r)
    head = "transcription_compute_ms."
    return {k[len(head) :]: v for k, v in metrics.items() if k.startswith(head)}


def test_each_turn_is_transcribed_and_nothing_answers_or_speaks(
    own_server: str, speech: np.ndarray
) -> None:
    async def body() -> None:
        async with connect(own_server) as conn:
            created = await until(conn, "session.created")
            assert created.session.type == "transcription"
            await conn.session.update(
                session={
                    "type": "transcription",
                    "audio": {
                        "input": {
                            "transcription": {"model": "qwen3-omni", "language": "en"},
                            "turn_detection": {"type": "server_vad", "silence_duration_ms": 500},
                        }
                    },
                }
            )
            updated = await until(conn, "session.updated")
            assert updated.session.audio.input.transcription.language == "en"
            gap = np.zeros(24000, np.float32)  # 1 s: each turn ends before the next
            audio = np.concatenate([gap[:4800], speech, gap, speech, gap])
            sender = asyncio.create_task(send_audio(conn, audio, pace_s=0.03))
            seen: list[Any] = []
            completed = []
            while len(completed) < 2:
                completed.append(
                    await until(
                        conn, "conversation.item.input_audio_transcription.completed", seen, 30
                    )
                )
            await sender
            await conn.send({"type": "response.create"})
            refused = await until(conn, "error", seen)
            assert refused.error.code == "invalid_value" and refused.error.param == "type"
            kinds = [ev.type for _, ev in seen]
            assert not [k for k in kinds if k.startswith(("response.", "output_audio_buffer."))]
            committed = [ev.item_id for _, ev in seen if ev.type == "input_audio_buffer.committed"]
            assert committed == [c.item_id for c in completed]
            for c in completed:
                mine = [ev for _, ev in seen if getattr(ev, "item_id", None) == c.item_id]
                order = [ev.type for ev in mine]
                deltas = [
                    ev.delta
                    for ev in mine
                    if ev.type == "conversation.item.input_audio_transcription.delta"
                ]
                assert deltas and "".join(deltas).strip() == c.transcript != ""
                assert order.index("input_audio_buffer.speech_started") < order.index(
                    "input_audio_buffer.committed"
                )
                assert c.usage.type == "tokens"
            # What each transcription's request cost each stage, once every stage has said.
            deadline = time.monotonic() + timeout(10)
            while (cost := compute_ms(own_server)).get("thinker", {}).get("n", 0) < 2:
                assert time.monotonic() < deadline, cost
                await asyncio.sleep(0.1)
        print("transcription compute per stage, ms:", {k: v["sum"] for k, v in cost.items()})
        assert cost["thinker"]["sum"] > 0 and cost["audio_encoder"]["sum"] > 0
        assert {s: cost.get(s, {}).get("sum", 0) for s in SPEECH_STAGES} == dict.fromkeys(
            SPEECH_STAGES, 0
        )

    run(body())
