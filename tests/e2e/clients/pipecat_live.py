"""Run by Pipecat's own environment (`.cache/venvs/pipecat`, see the Makefile), not by pytest:
Pipecat's `OpenAILiveLLMService` (OpenAI's Live API) pointed at the server, in a pipeline with
its context aggregators and no transport.

    python pipecat_live.py ws://127.0.0.1:8000/v1/live/sessions speech.pcm > summary.json

The service has no delegation backend, so it answers the model's delegation itself (its
decline, as commentary for that delegation). A microphone streams continuously (silence between
sentences). The person speaks; the model delegates, the answer is spoken; the person speaks
again, and a third time at the first audio of that answer; an EndFrame closes the session
(`session.close`, then `session.closed`). Prints one JSON object: the errors Pipecat raised, the
delegations, the server events by type, the transcripts (its own events' deltas), the user
turns its aggregator wrote to the context, the loud runs of output audio on the
output clock (ms)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    Frame,
    InputAudioRawFrame,
    LLMRunFrame,
    SpeechOutputAudioRawFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.runner import PipelineRunner
from pipecat.pipeline.task import PipelineTask
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.live import events
from pipecat.services.openai.live.llm import OpenAILiveLLMService

RATE_HZ = 24000
CHUNK = 960  # bytes: 20 ms of 24 kHz pcm16


class Service(OpenAILiveLLMService):
    """The service, counting the server events it gets."""

    def __init__(self, out: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.out = out

    async def _handle_server_event(self, evt: events.ServerEvent) -> None:
        o = self.out
        o["server"][evt.type] = o["server"].get(evt.type, 0) + 1
        if isinstance(evt, events.TranscriptDeltaEvent):
            o["said" if evt.role == "assistant" else "heard"] += evt.delta
        elif isinstance(evt, events.SessionDelegationCreatedEvent):
            o["delegations"].append(evt.delegation.id)
        elif isinstance(evt, events.SessionClosedEvent):
            o["closed_reason"] = evt.reason
        elif isinstance(evt, events.ErrorEvent):
            o["errors"].append(evt.error.model_dump())
        await super()._handle_server_event(evt)


class Ears(FrameProcessor):
    """Downstream of the service: the output audio's loud runs on the output clock, and what
    else the pipeline says (errors)."""

    def __init__(self, out: dict[str, Any]) -> None:
        super().__init__()
        self.out, self.out_ms = out, 0.0
        self.runs: list[list[float]] = []
        self.first_audio = asyncio.Event()

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, SpeechOutputAudioRawFrame):
            ms = len(frame.audio) / 2 / RATE_HZ * 1000
            if any(frame.audio):
                if self.runs and self.out_ms - self.runs[-1][1] < 300:
                    self.runs[-1][1] = self.out_ms + ms
                else:
                    self.runs.append([self.out_ms, self.out_ms + ms])
                    self.first_audio.set()
            self.out_ms += ms
        elif isinstance(frame, ErrorFrame):
            self.out["errors"].append(str(frame.error)[:300])
        await self.push_frame(frame, direction)


async def wait_for(cond: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def main(url: str, speech_path: str) -> dict[str, Any]:
    pcm = Path(speech_path).read_bytes()
    out: dict[str, Any] = {"errors": [], "delegations": [], "server": {}}
    out["said"], out["heard"], out["closed_reason"] = "", "", None
    llm = Service(
        out,
        api_key="test",
        base_url=url,
        settings=OpenAILiveLLMService.Settings(system_instruction="Be brief.", voice="marin"),
    )
    pair = LLMContextAggregatorPair(LLMContext())
    ears = Ears(out)
    task = PipelineTask(Pipeline([pair.user(), llm, ears, pair.assistant()]))
    running = asyncio.create_task(PipelineRunner(handle_sigint=False).run(task))
    await task.queue_frame(LLMRunFrame())  # session.start
    queued: deque[bytes] = deque()

    async def microphone() -> None:
        next_s = time.monotonic()
        while True:
            data = queued.popleft() if queued else bytes(CHUNK)
            await task.queue_frame(
                InputAudioRawFrame(audio=data, sample_rate=RATE_HZ, num_channels=1)
            )
            next_s += 0.02
            await asyncio.sleep(max(0.0, next_s - time.monotonic()))

    async def say() -> None:
        queued.extend(pcm[i : i + CHUNK].ljust(CHUNK, b"\0") for i in range(0, len(pcm), CHUNK))
        await wait_for(lambda: not queued, 30)

    mic = asyncio.create_task(microphone())
    await wait_for(lambda: out["server"].get("session.started"), 15)
    # 1. Speech in; the model delegates; the decline comes back as the result; it is spoken.
    await say()
    if not await wait_for(lambda: "sunny" in out["said"], 30):
        out["errors"].append("timed out: no answer spoken after the delegation")
    await wait_for(lambda: ears.runs and ears.out_ms - ears.runs[-1][1] > 1500, 10)
    # The loud audio of the answers so far (an underrun on a busy machine splits a run; it
    # takes nothing from this sum).
    out["loud_ms_first"] = sum(end - start for start, end in ears.runs)
    # 2. Speech again; at the first audio of its answer the person speaks over it.
    ears.first_audio.clear()
    await say()
    try:
        await asyncio.wait_for(ears.first_audio.wait(), 20)
    except TimeoutError:
        out["errors"].append("timed out: no spoken answer to the second speech")
    out["cut_run"] = len(ears.runs) - 1
    await say()
    await wait_for(lambda: ears.out_ms - ears.runs[-1][1] > 1500, 10)
    out["runs"] = ears.runs
    mic.cancel()
    await task.queue_frame(EndFrame())  # session.close, then session.closed
    await asyncio.wait_for(running, 20)
    messages = pair.user().context.get_messages()
    out["context"] = [m.get("role") if isinstance(m, dict) else None for m in messages]
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
