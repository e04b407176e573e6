"""Run by the OpenAI Agents SDK's own environment (`.cache/venvs/agents`, see the Makefile), not
by pytest: a RealtimeAgent with its default settings and one function tool talks to the server.

    python agents_call.py ws://127.0.0.1:8000/v1/realtime speech.pcm > summary.json

`speech.pcm` is 24 kHz mono pcm16 (the SDK's default format). It asks its question, lets the
tool run and the answer start, then talks over the answer. Prints one JSON object: every SDK
error, the tools run, audio chunks heard per response, whether an interruption was seen."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from agents import function_tool
from agents.realtime import RealtimeAgent, RealtimeRunner

CHUNK = 4800  # bytes: 100 ms of 24 kHz pcm16


@function_tool
def get_weather(city: str) -> str:
    """The weather now in a city."""
    return json.dumps({"city": city, "sunny": True})


async def say(session: Any, pcm: bytes, then_silence_s: float) -> None:
    """Speak in real time, as a microphone would."""
    audio = pcm + bytes(int(then_silence_s * 48000))
    for i in range(0, len(audio), CHUNK):
        await session.send_audio(audio[i : i + CHUNK])
        await asyncio.sleep(0.1)


async def main(url: str, speech_path: str) -> dict[str, Any]:
    pcm = Path(speech_path).read_bytes()
    agent = RealtimeAgent(name="Weather", instructions="Be brief.", tools=[get_weather])
    runner = RealtimeRunner(agent)
    out: dict[str, Any] = {"errors": [], "tools": [], "audio": 0, "interrupted": False}
    out["raw"] = []
    async with await runner.run(model_config={"url": url, "api_key": "test"}) as session:
        asker = asyncio.create_task(say(session, pcm, 1.5))
        interrupter: list[asyncio.Task[None]] = []

        async def consume() -> None:
            async for ev in session:
                if ev.type == "error":
                    out["errors"].append(repr(ev.error)[:500])
                elif ev.type == "raw_model_event" and ev.data.type == "raw_server_event":
                    out["raw"].append(ev.data.data.get("type"))
                elif ev.type == "tool_end":
                    out["tools"].append({"name": ev.tool.name, "output": str(ev.output)})
                elif ev.type == "audio":
                    out["audio"] += 1
                    if out["tools"] and not interrupter:  # the answer after the tool speaks
                        interrupter.append(asyncio.create_task(say(session, pcm, 1.5)))
                elif ev.type == "audio_interrupted":
                    out["interrupted"] = True
                if out["interrupted"] and interrupter and interrupter[0].done():
                    return

        try:
            await asyncio.wait_for(consume(), 90)
        except TimeoutError:
            out["errors"].append("timed out: the call stopped short of an interruption")
        asker.cancel()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
