"""Run by Pipecat's own environment (`.cache/venvs/pipecat`, see the Makefile), not by pytest:
Pipecat's OpenAI Realtime service, pointed at the server, in a pipeline with no transport.

    python pipecat_call.py ws://127.0.0.1:8000/v1/realtime speech.pcm > summary.json

It speaks `speech.pcm` (24 kHz mono pcm16) into the pipeline as a microphone would, lets the
registered tool run, then speaks again over the answer. Prints one JSON object: the errors
Pipecat raised, the tools run, the audio frames that came out, the transcripts, and how many
frames of each type the pipeline passed."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema
from pipecat.frames.frames import (
    ErrorFrame,
    FunctionCallResultFrame,
    InputAudioRawFrame,
    LLMRunFrame,
    TranscriptionFrame,
    TTSAudioRawFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.tests.utils import SleepFrame, run_test

CHUNK = 960  # bytes: 20 ms of 24 kHz pcm16


def mic(pcm: bytes, then_silence_s: float) -> list[Any]:
    audio = pcm + bytes(int(then_silence_s * 48000))
    frames: list[Any] = []
    for i in range(0, len(audio), CHUNK):
        piece = audio[i : i + CHUNK]
        frames.append(InputAudioRawFrame(audio=piece, sample_rate=24000, num_channels=1))
        frames.append(SleepFrame(sleep=0.02))
    return frames


async def main(url: str, speech_path: str) -> dict[str, Any]:
    pcm = Path(speech_path).read_bytes()
    out: dict[str, Any] = {"errors": [], "tools": [], "audio": 0, "transcripts": []}

    async def get_weather(params: Any) -> None:
        out["tools"].append({"name": params.function_name, "arguments": dict(params.arguments)})
        await params.result_callback({"city": params.arguments.get("city"), "sunny": True})

    weather = FunctionSchema(
        name="get_weather",
        description="The weather now in a city",
        properties={"city": {"type": "string"}},
        required=["city"],
    )
    llm = OpenAIRealtimeLLMService(
        api_key="test",
        base_url=url,
        settings=OpenAIRealtimeLLMService.Settings(system_instruction="Be brief."),
    )
    llm.register_function("get_weather", get_weather)
    context = LLMContext(tools=ToolsSchema(standard_tools=[weather]))
    pair = LLMContextAggregatorPair(context)
    # LLMRunFrame: the context goes to the service and it asks for a first answer (as a bot that
    # greets); then the person speaks, twice, the second time over the answer.
    frames = [LLMRunFrame(), SleepFrame(sleep=4.0), *mic(pcm, 1.5), SleepFrame(sleep=1.0)]
    frames += mic(pcm, 1.5)
    frames.append(SleepFrame(sleep=4.0))
    down, up = await run_test(
        Pipeline([pair.user(), llm, pair.assistant()]),
        frames_to_send=frames,
        start_timeout=10.0,
    )
    kinds: dict[str, int] = {}
    for f in [*down, *up]:
        kinds[type(f).__name__] = kinds.get(type(f).__name__, 0) + 1
    out["frames"] = kinds
    for f in [*down, *up]:
        if isinstance(f, ErrorFrame):
            out["errors"].append(str(f.error)[:300])
        elif isinstance(f, TTSAudioRawFrame):
            out["audio"] += 1
        elif isinstance(f, TranscriptionFrame):
            out["transcripts"].append(f.text)
        elif isinstance(f, FunctionCallResultFrame):
            out["tools"].append({"result": str(f.result)[:200]})
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
