"""Function calling and text-only answers through the real stages (the tiny model), against a
real `realtime-omni serve`: the thinker is the real one with its sampling scripted
(`executors.ScriptedThinker`), since random weights never call a tool; its tokens go through
the real decode stage, the gateway's tool-call parsing, the talker and code2wav."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import websockets
import yaml

from tests.conftest import ROOT, run, timeout
from tests.e2e.conftest import serving
from tests.e2e.test_webrtc import get_json

pytestmark = pytest.mark.slow

SAY_FIRST = "Let me check."
CALL = (
    SAY_FIRST + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
ANSWER = "It is sunny in Paris."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tools") / "thinker.jsonl"


@pytest.fixture(scope="module")
def server(record: Path) -> Iterator[str]:
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    thinker = cfg["stages"]["thinker"]
    thinker["executor"] = "tests.e2e.executors:ScriptedThinker"
    thinker["params"].update(call=CALL, answer=ANSWER, record_to=str(record))
    # Random talker weights never end an answer: each runs to max_frames, and a WebSocket client
    # takes it in real time. 60 frames (4.8 s) still outlast every interruption here, at a
    # third of the tiny config's 200 (16 s an answer).
    cfg["stages"]["talker_ar"]["params"]["max_frames"] = 60
    path = record.with_name("tools.yaml")
    path.write_text(yaml.safe_dump(cfg))
    with serving("--max-sessions", "2", config=path) as url:
        yield url


class Client:
    def __init__(self, ws: Any) -> None:
        self.ws = ws

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(event))

    async def until(self, kind: str) -> list[dict[str, Any]]:
        """Every event up to and including the next of type `kind`."""
        got = []
        while True:
            ev = json.loads(await asyncio.wait_for(self.ws.recv(), timeout(60)))
            got.append(ev)
            if ev["type"] == kind:
                return got

    async def ask(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        await self.send({"type": "conversation.item.create", "item": item})
        await self.send({"type": "response.create"})
        return await self.until("response.done")


def user_text(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_tool_call_round_trip_is_written_not_said(server: str, record: Path) -> None:
    async def body() -> None:
        url = server.replace("http://", "ws://") + "/v1/realtime"
        async with websockets.connect(url, max_size=1 << 24) as ws:
            c = Client(ws)
            await c.until("session.created")
            session = {"type": "realtime", "instructions": "Be brief.", "tools": [WEATHER]}
            await c.send({"type": "session.update", "session": session})
            updated = (await c.until("session.updated"))[-1]
            assert updated["session"]["tools"] == [WEATHER]

            events = await c.ask(user_text("What is the weather in Paris?"))
            kinds = [e["type"] for e in events]
            assert "error" not in kinds, events
            said = "".join(
                e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta"
            )
            assert said == SAY_FIRST  # the call is not part of what was said
            (args,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
            assert args["name"] == "get_weather" and json.loads(args["arguments"]) == {
                "city": "Paris"
            }
            done = [e for e in events if e["type"] == "response.output_item.done"]
            (call,) = [e["item"] for e in done if e["item"]["type"] == "function_call"]
            assert call["status"] == "completed" and call["call_id"] == args["call_id"]
            response = events[-1]["response"]
            assert response["status"] == "completed"
            assert [o["type"] for o in response["output"]] == ["message", "function_call"]
            assert any(e["type"] == "response.output_audio.delta" for e in events)

            first = records(record)[-1]
            assert "<tools>" in first["prompt"] and '"name": "get_weather"' in first["prompt"]
            # the talker was given the words before the call, and nothing of the call, and
            # its speech was ended there (its end-of-text row, not padding for ever)
            assert first["spoken_text"] == SAY_FIRST and first["speech_ended"]
            output = {"type": "function_call_output", "call_id": call["call_id"]}
            output["output"] = json.dumps({"sunny": True})
            events = await c.ask(output)
            said = "".join(
                e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta"
            )
            assert said == ANSWER and events[-1]["response"]["status"] == "completed"
            second = records(record)[-1]
            assert second["spoken_tokens"] == second["tokens"]  # all of it said
            assert second["spoken_text"] == ANSWER and second["speech_ended"]
            assert "<tool_response>" in second["prompt"] and '{"sunny": true}' in second["prompt"]
            assert (
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                in (second["prompt"])
            )

    run(body(), 240)


def test_a_text_only_answer_leaves_the_talker_and_vocoder_idle(server: str, record: Path) -> None:
    async def body() -> None:
        url = server.replace("http://", "ws://") + "/v1/realtime"
        async with websockets.connect(url, max_size=1 << 24) as ws:
            c = Client(ws)
            await c.until("session.created")
            await c.send({"type": "session.update", "session": {"output_modalities": ["text"]}})
            await c.until("session.updated")
            since = time.monotonic()
            events = await c.ask(user_text("Say something short."))
            kinds = [e["type"] for e in events]
            assert "response.output_audio.delta" not in kinds
            text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
            (done,) = [e for e in events if e["type"] == "response.output_text.done"]
            assert text and done["text"] == text
            item = events[-1]["response"]["output"][0]
            assert item["content"] == [{"type": "output_text", "text": text}]
            assert events[-1]["response"]["output_modalities"] == ["text"]
            st = await asyncio.to_thread(get_json, f"{server}/v1/stats?since={since}")
            text_steps = st["steps_since"]
            assert records(record)[-1]["spoken_tokens"] == 0  # the thinker sent no speech
            # The same answer spoken, for comparison: the talker steps once per 80 ms frame.
            await c.send({"type": "session.update", "session": {"output_modalities": ["audio"]}})
            await c.until("session.updated")
            since = time.monotonic()
            events = await c.ask(user_text("Say something short."))
            assert any(e["type"] == "response.output_audio.delta" for e in events)
            st = await asyncio.to_thread(get_json, f"{server}/v1/stats?since={since}")
            spoken_steps = st["steps_since"]
            # Text only: at most the one step that ends the empty request, no forward.
            assert text_steps["thinker"] > 0
            assert text_steps["talker_ar"] <= 1 and text_steps["code2wav"] <= 1, text_steps
            # (random talker weights: a frame, then at least the step that ends it)
            assert spoken_steps["talker_ar"] >= 2 and spoken_steps["code2wav"] >= 1, spoken_steps

    run(body(), 240)


CLIENTS = ROOT / ".cache" / "venvs"  # each third-party client's own environment (Makefile)
AGENTS_PY = CLIENTS / "agents" / "bin" / "python"


def run_client(python: Path, script: str, url: str, pcm: Path, cwd: Path) -> dict[str, Any]:
    """A client script of tests/e2e/clients/ in its environment; the JSON summary it prints."""
    if not python.exists():
        pytest.fail(f"{python.parent.parent.name}'s environment is missing: run `make install`")
    path = ROOT / "tests" / "e2e" / "clients" / script
    proc = subprocess.Popen(
        [str(python), str(path), url, str(pcm)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout(120))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{script} did not end: {err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    return dict(json.loads(out.strip().splitlines()[-1]))


def pcm_file(speech: Any, tmp_path: Path) -> Path:
    pcm = tmp_path / "speech.pcm"
    pcm.write_bytes((np.clip(speech, -1, 1) * 32767).astype("<i2").tobytes())
    return pcm


def test_the_openai_agents_sdk_with_its_defaults_calls_the_tool_and_is_interrupted(
    server: str, speech: Any, tmp_path: Path
) -> None:
    """The Agents SDK's realtime session, default settings (semantic_vad, transcription, the
    voice "ash", tracing), one function tool: audio in, the tool's round trip, audio out, a
    barge-in, and not one error event."""
    url = server.replace("http://", "ws://") + "/v1/realtime?model=gpt-realtime"
    summary = run_client(AGENTS_PY, "agents_call.py", url, pcm_file(speech, tmp_path), tmp_path)
    assert summary["errors"] == [], summary
    assert [t["name"] for t in summary["tools"]] == ["get_weather"], summary
    assert summary["audio"] > 0 and summary["interrupted"], summary
    raw = summary["raw"]
    assert "response.function_call_arguments.done" in raw
    assert "conversation.item.input_audio_transcription.completed" in raw  # its default


def test_pipecats_openai_realtime_service_calls_the_tool_and_is_interrupted(
    server: str, speech: Any, tmp_path: Path
) -> None:
    """Pipecat's OpenAI Realtime service in a pipeline with its context aggregators and no
    transport: a first answer (its tool call), audio in, audio out, the tool's result, speech
    over the answer; Pipecat stops reading at almost any error event, so none may come."""
    url = server.replace("http://", "ws://") + "/v1/realtime"
    python = CLIENTS / "pipecat" / "bin" / "python"
    summary = run_client(python, "pipecat_call.py", url, pcm_file(speech, tmp_path), tmp_path)
    assert summary["errors"] == [], summary
    called = [t for t in summary["tools"] if "name" in t]
    assert called == [{"name": "get_weather", "arguments": {"city": "Paris"}}], summary
    frames = summary["frames"]
    assert frames.get("FunctionCallResultFrame", 0) >= 1, frames
    assert frames.get("TTSAudioRawFrame", 0) > 0, frames
    assert frames.get("InterruptionFrame", 0) >= 1, frames  # the speech over the answer
