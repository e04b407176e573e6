"""Run by LiveKit Agents' own environment (`.cache/venvs/livekit`, see the Makefile), not by
pytest: an `AgentSession` with `livekit-plugins-openai`'s `GPTLiveModel` (OpenAI's Live API,
client delegation), pointed at the server, with no room.

    python livekit_live.py http://127.0.0.1:8000/v1 speech.pcm > summary.json

`speech.pcm` is 24 kHz mono pcm16. The microphone streams continuously (silence between
sentences, as a room's track does). The person speaks; the model delegates, the script answers
the delegation with `append_commentary`, the model speaks the result; the person speaks again,
and a third time at the first audio of that answer. Prints one JSON object: the errors, the
delegations, the server events by type, the transcripts, the loud runs of output audio on the
output clock (ms) and when the third sentence began on that clock."""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from livekit import rtc
from livekit.agents import Agent, AgentSession, utils
from livekit.agents.voice.io import AudioInput, AudioOutput, AudioOutputCapabilities
from livekit.plugins import openai

RATE_HZ = 24000
FRAME_SAMPLES = 480  # 20 ms, as a microphone sends it
RESULT = '{"city": "Paris", "sunny": true}'


class Mic(AudioInput):
    """A microphone that never stops: what `say` queued, else silence, 20 ms a frame."""

    def __init__(self) -> None:
        super().__init__(label="mic")
        self.ch = utils.aio.Chan[rtc.AudioFrame]()
        self.queued: deque[bytes] = deque()
        self.task = asyncio.create_task(self._run())

    async def __anext__(self) -> rtc.AudioFrame:
        return await self.ch.__anext__()

    async def _run(self) -> None:
        step, silence = FRAME_SAMPLES * 2, bytes(FRAME_SAMPLES * 2)
        next_s = time.monotonic()
        while True:
            data = self.queued.popleft() if self.queued else silence
            self.ch.send_nowait(rtc.AudioFrame(data.ljust(step, b"\0"), RATE_HZ, 1, FRAME_SAMPLES))
            next_s += 0.02
            await asyncio.sleep(max(0.0, next_s - time.monotonic()))

    async def say(self, pcm: bytes) -> None:
        step = FRAME_SAMPLES * 2
        self.queued.extend(pcm[i : i + step] for i in range(0, len(pcm), step))
        while self.queued:
            await asyncio.sleep(0.02)


class Speaker(AudioOutput):
    """Plays in real time: each burst the framework hands over is counted in frames."""

    def __init__(self) -> None:
        super().__init__(
            label="speaker",
            next_in_chain=None,
            sample_rate=RATE_HZ,
            capabilities=AudioOutputCapabilities(pause=False),
        )
        self.frames: list[int] = []
        self._pushed_s = 0.0

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await super().capture_frame(frame)
        if not self._pushed_s:
            self.on_playback_started(created_at=time.time())
            self.frames.append(0)
        self.frames[-1] += 1
        self._pushed_s += frame.duration

    def flush(self) -> None:
        super().flush()
        if self._pushed_s:
            pushed, self._pushed_s = self._pushed_s, 0.0
            self.on_playback_finished(
                playback_position=pushed, interrupted=False, synchronized_transcript=None
            )

    def clear_buffer(self) -> None:
        self._pushed_s = 0.0


class Ears:
    """The output stream as the server sent it: loud runs on the output clock."""

    def __init__(self) -> None:
        self.out_ms = 0.0
        self.runs: list[list[float]] = []  # [start_ms, end_ms] of audio that is not silence
        self.first_audio = asyncio.Event()

    def delta(self, b64: str) -> None:
        data = base64.b64decode(b64)
        ms = len(data) / 2 / RATE_HZ * 1000
        if any(data):
            if self.runs and self.out_ms - self.runs[-1][1] < 300:
                self.runs[-1][1] = self.out_ms + ms
            else:
                self.runs.append([self.out_ms, self.out_ms + ms])
                self.first_audio.set()
        self.out_ms += ms


async def wait_for(cond: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def main(base_url: str, speech_path: str) -> dict[str, Any]:
    pcm = Path(speech_path).read_bytes()
    out: dict[str, Any] = {"errors": [], "delegations": [], "server": {}, "error_events": []}
    out["heard"], out["said"] = "", ""
    model = openai.realtime.GPTLiveModel(
        base_url=base_url, api_key="test", model="qwen3-omni", voice="marin", delegation="client"
    )
    session: AgentSession[None] = AgentSession(llm=model)
    mic, speaker, ears = Mic(), Speaker(), Ears()
    session.input.audio = mic
    session.output.audio = speaker

    @session.on("error")
    def _error(ev: Any) -> None:
        out["errors"].append(repr(ev.error)[:500])

    agent = Agent(instructions="Be brief.")
    await session.start(agent)
    live = agent.duplex_session

    def server_event(ev: dict[str, Any]) -> None:
        kind = str(ev.get("type"))
        out["server"][kind] = out["server"].get(kind, 0) + 1
        if kind == "session.output_audio.delta":
            ears.delta(ev["delta"])
        elif kind == "session.output_transcript.delta":
            out["said"] += ev["delta"]
        elif kind == "session.input_transcript.delta":
            out["heard"] += ev["delta"]
            out.setdefault("heard_spans", []).append([ev.get("start_ms"), ev.get("end_ms")])
        elif kind == "error":
            out["error_events"].append(ev["error"])

    def delegated(d: Any) -> None:
        out["delegations"].append({"id": d.id})
        live.append_commentary(RESULT, delegation_id=d.id)  # type: ignore[attr-defined]

    live.on("openai_server_event_received", server_event)
    live.on("delegation_created", delegated)

    # 1. Speech in: the server ends the turn, the model delegates, the result is spoken.
    await mic.say(pcm)
    if not await wait_for(lambda: "sunny" in out["said"], 30):
        out["errors"].append("timed out: no answer spoken after the delegation")
    await wait_for(lambda: ears.runs and ears.out_ms - ears.runs[-1][1] > 1500, 10)
    # The loud audio of the answers so far (an underrun on a busy machine splits a run; it
    # takes nothing from this sum).
    out["loud_ms_first"] = sum(end - start for start, end in ears.runs)
    # 2. Speech again; at the first audio of its answer the person speaks over it.
    ears.first_audio.clear()
    await mic.say(pcm)
    try:
        await asyncio.wait_for(ears.first_audio.wait(), 20)
    except TimeoutError:
        out["errors"].append("timed out: no spoken answer to the second speech")
    out["barge_at_ms"], out["cut_run"] = ears.out_ms, len(ears.runs) - 1
    await mic.say(pcm)
    await wait_for(lambda: ears.out_ms - ears.runs[-1][1] > 1500, 10)
    out["runs"] = ears.runs
    out["speaker_frames"] = speaker.frames
    out["session_id"] = live.session_id
    await session.aclose()
    await model.aclose()
    mic.task.cancel()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
