"""Run by LiveKit Agents' own environment (`.cache/venvs/livekit`, see the Makefile), not by
pytest: an `AgentSession` with `livekit-plugins-openai`'s `RealtimeModel` at its defaults,
pointed at the server, with no room (LiveKit's test harness: audio in and out through
`session.input.audio` / `session.output.audio`).

    python livekit_call.py http://127.0.0.1:8000/v1 speech.pcm > summary.json

`speech.pcm` is 24 kHz mono pcm16. A typed turn whose answer calls the one function tool and
then speaks; then the person speaks, and speaks again at the first audio of that answer. Prints
one JSON object: the errors the session reported, the server's `error` events, the tools run,
what the typed turn's run returned, the server events (each checked against the `openai` types
the plugin builds them as), the audio frames played per answer and which answers were
interrupted."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import typing
from pathlib import Path
from typing import Any

from livekit import rtc
from livekit.agents import Agent, AgentSession, function_tool, utils
from livekit.agents.voice.io import AudioInput, AudioOutput, AudioOutputCapabilities
from livekit.plugins import openai
from openai.types.realtime import RealtimeServerEvent
from pydantic import TypeAdapter, ValidationError

RATE_HZ = 24000
FRAME_SAMPLES = 480  # 20 ms, as a microphone sends it
SERVER_EVENTS: TypeAdapter[Any] = TypeAdapter(RealtimeServerEvent)


@function_tool
async def get_weather(city: str) -> str:
    """The weather now in a city."""
    return json.dumps({"city": city, "sunny": True})


class Mic(AudioInput):
    """Frames pushed by the script, read by the session."""

    def __init__(self) -> None:
        super().__init__(label="mic")
        self.ch = utils.aio.Chan[rtc.AudioFrame]()

    async def __anext__(self) -> rtc.AudioFrame:
        return await self.ch.__anext__()

    async def say(self, pcm: bytes, then_silence_s: float) -> None:
        """Speak in real time: 20 ms frames every 20 ms."""
        audio = pcm + bytes(int(then_silence_s * RATE_HZ) * 2)
        step = FRAME_SAMPLES * 2
        for i in range(0, len(audio) - step + 1, step):
            self.ch.send_nowait(rtc.AudioFrame(audio[i : i + step], RATE_HZ, 1, FRAME_SAMPLES))
            await asyncio.sleep(0.02)


class Speaker(AudioOutput):
    """Plays in real time (as a room's track would): playback starts at the first frame and
    finishes after the audio's duration, or when the session clears it (an interruption)."""

    def __init__(self) -> None:
        super().__init__(
            label="speaker",
            next_in_chain=None,
            sample_rate=RATE_HZ,
            capabilities=AudioOutputCapabilities(pause=False),
        )
        self.frames: list[int] = []  # frames played, one count per answer
        self.cleared = 0
        self.first_audio = asyncio.Event()  # set at an answer's first frame
        self._start = 0.0
        self._pushed_s = 0.0
        self._done: asyncio.TimerHandle | None = None

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await super().capture_frame(frame)
        if not self._pushed_s:
            self._start = time.time()
            self.on_playback_started(created_at=self._start)
            self.frames.append(0)
            self.first_audio.set()
        self.frames[-1] += 1
        self._pushed_s += frame.duration

    def flush(self) -> None:
        super().flush()
        if not self._pushed_s:
            return
        pushed = self._pushed_s

        def finished() -> None:
            self.on_playback_finished(
                playback_position=pushed, interrupted=False, synchronized_transcript=None
            )
            self._pushed_s = 0.0

        if self._done:
            self._done.cancel()
        delay = max(0.0, pushed - (time.time() - self._start))
        self._done = asyncio.get_running_loop().call_later(delay, finished)

    def clear_buffer(self) -> None:
        if not self._pushed_s:
            return
        self.cleared += 1
        if self._done:
            self._done.cancel()
            self._done = None
        self.on_playback_finished(
            playback_position=min(self._pushed_s, time.time() - self._start),
            interrupted=True,
            synchronized_transcript=None,
        )
        self._pushed_s = 0.0


async def main(base_url: str, speech_path: str) -> dict[str, Any]:
    pcm = Path(speech_path).read_bytes()
    out: dict[str, Any] = {"errors": [], "error_events": [], "tools": [], "server": []}
    out["invalid"] = {}
    model = openai.realtime.RealtimeModel(base_url=base_url, model="qwen3-omni", api_key="test")
    session: AgentSession[None] = AgentSession(llm=model)
    mic, speaker = Mic(), Speaker()
    session.input.audio = mic
    session.output.audio = speaker

    @session.on("error")
    def _error(ev: Any) -> None:
        out["errors"].append(repr(ev.error)[:500])

    @session.on("function_tools_executed")
    def _tools(ev: Any) -> None:
        for call, result in ev.zipped():
            out["tools"].append({"name": call.name, "arguments": json.loads(call.arguments)})
            out["tools"][-1]["output"] = result.output if result else None

    def server_event(ev: dict[str, Any]) -> None:
        kind = str(ev.get("type"))
        out["server"].append(kind)
        if kind == "error":
            out["error_events"].append(ev["error"])
        try:
            SERVER_EVENTS.validate_python(ev)
        except ValidationError as e:
            problems = [f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()]
            out["invalid"].setdefault(kind, problems[:3])

    agent = Agent(instructions="Be brief.", tools=[get_weather])
    await session.start(agent)
    # The session's first `session.update` is already queued: only `session.created` can come
    # before this handler, and the server's event log checks that one.
    rt = typing.cast(openai.realtime.RealtimeSession, agent.realtime_llm_session)
    rt.on("openai_server_event_received", server_event)

    # 1. A typed turn: the tool's round trip, then its spoken answer, played to the end.
    run = session.run(user_input="What is the weather in Paris?")
    await asyncio.wait_for(run, 30)
    out["run"] = [ev.type for ev in run.events]
    out["answer"] = [
        ev.item.text_content
        for ev in run.events
        if ev.type == "message" and ev.item.role == "assistant"
    ]
    # 2. Speech: the server's VAD ends the turn and answers; at that answer's first audio the
    # person speaks again, and the answer is cut there.
    speaker.first_audio.clear()
    answers = len(speaker.frames)
    speaking = asyncio.create_task(mic.say(pcm, 3.0))
    try:
        await asyncio.wait_for(speaker.first_audio.wait(), 20)
    except TimeoutError:
        out["errors"].append("timed out: no spoken answer to the speech")
    speaking.cancel()  # its trailing silence: the person speaks again instead
    await mic.say(pcm, 1.0)
    out["audio"] = speaker.frames
    out["spoken_answers"] = len(speaker.frames) - answers
    out["cleared"] = speaker.cleared
    out["interrupted"] = [
        it.interrupted
        for it in session.history.items
        if it.type == "message" and it.role == "assistant"
    ]
    await session.aclose()
    await model.aclose()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
