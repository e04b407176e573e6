"""Executors for e2e tests (imported by the stage processes of a served config by module path)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from realtime_omni.models.qwen3_omni.thinker import ThinkerExecutor
from realtime_omni.pipeline.executor import StageContext
from realtime_omni.pipeline.simulated import SimulatedExecutor


class PayloadRecorder(SimulatedExecutor):
    """A simulated entry stage that appends one JSON line per request to `params.record_to`:
    `{"request_id", "content": [part types of the last user message], "images": [{"shape",
    "mean_rgb"} of every image in the request]}`, so a test sees what a turn really carried into
    the pipeline."""

    def __init__(self, ctx: StageContext) -> None:
        super().__init__(ctx)
        self.record_to = str(ctx.params["record_to"])

    def add_request(self, request_id: str, inputs: dict[str, dict[str, Any]]) -> None:
        super().add_request(request_id, inputs)
        (payload,) = inputs.values()
        # A system or assistant message's content is a string; a user message's, a list of parts.
        lists = [m["content"] for m in payload["messages"] if isinstance(m["content"], list)]
        content = lists[-1] if lists else []
        images = [payload[p["image"]] for ps in lists for p in ps if p["type"] == "image"]
        record = {
            "request_id": request_id,
            "content": [p["type"] for p in content],
            "images": [
                {"shape": list(a.shape), "mean_rgb": np.asarray(a).mean(axis=(0, 1)).tolist()}
                for a in images
            ],
        }
        with open(self.record_to, "a") as f:
            f.write(json.dumps(record) + "\n")


class ScriptedThinker(ThinkerExecutor):
    """The real thinker (tiny weights, real prefill and decode steps, real emits) with its
    sampling replaced by a script, since random weights never call a tool: a turn whose prompt
    holds a `<tool_response>` answers `params.answer`, a transcription request (the gateway's
    instruction) `params.transcript`, any other turn says `params.call` (which may hold a
    `<tool_call>`). Appends one JSON line per request to `params.record_to`:
    the prompt as text, how many tokens went to the speech stage, what the talker was given to
    say (the tokens before the one marked `last`, which ends the speech: the stop token, or a
    `<tool_call>`) and whether its speech was ended."""

    def __init__(self, ctx: StageContext) -> None:
        super().__init__(ctx)
        from realtime_omni.models.qwen3_omni.processor import load_processor
        from realtime_omni.models.qwen3_omni.weights import model_dir

        self.tokenizer = load_processor(model_dir(ctx.model)).tokenizer
        self.call, self.answer = str(ctx.params["call"]), str(ctx.params["answer"])
        self.transcript = str(ctx.params.get("transcript", "What is the weather in Paris?"))
        self.record_to = str(ctx.params["record_to"])
        self.script: dict[str, list[int]] = {}
        self.spoken: dict[str, int] = {}
        self.said: dict[str, int] = {}
        self.ended: dict[str, bool] = {}
        self.prompts: dict[str, str] = {}

    def add_request(self, request_id: str, inputs: dict[str, Any]) -> None:
        super().add_request(request_id, inputs)
        r = self.reqs[request_id]
        prompt = self.tokenizer.decode(r.ids.tolist())
        if "Transcribe the user's audio" in prompt:  # the gateway's input transcription
            text = self.transcript
        else:
            text = self.answer if "<tool_response>" in prompt else self.call
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.script[request_id] = [*ids, min(self.stop_ids)]
        r.max_tokens = len(self.script[request_id])
        self.spoken[request_id] = self.said[request_id] = 0
        self.ended[request_id] = False
        self.prompts[request_id] = prompt

    def _take(self, rid: str, tok: int, prompt_rows: Any) -> list[Any]:
        script, prompt, spoken = self.script[rid], self.prompts[rid], self.spoken[rid]
        said, ended = self.said[rid], self.ended[rid]
        forced = script[len(self.reqs[rid].tokens)]
        emits = super()._take(rid, forced, prompt_rows)  # the last token aborts: state gone
        speech = [e for e in emits if e.to == self.speech_to]
        spoken += len(speech)
        self.spoken[rid] = spoken
        ends = sum(1 for e in speech if (e.data or {}).get("last"))
        said += len(speech) - ends  # after the end no speech is sent
        ended = ended or ends > 0
        self.said[rid], self.ended[rid] = said, ended
        if any(e.done for e in emits):
            record = {"request_id": rid, "prompt": prompt, "spoken_tokens": spoken}
            record["tokens"] = len(script)
            record["speech_ended"] = ended
            record["spoken_text"] = self.tokenizer.decode(script[:said])
            with open(self.record_to, "a") as f:
                f.write(json.dumps(record) + "\n")
            self.abort(rid)
        return emits

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        for d in (self.script, self.spoken, self.said, self.ended, self.prompts):
            d.pop(request_id, None)
