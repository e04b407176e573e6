"""The serial baseline: the whole model in one stage, run by the reference
`Qwen3OmniMoeForConditionalGeneration.generate(..., return_audio=True)`: the thinker to its end,
then the talker to its end, then one vocoder pass. Nothing streams: the text and all the audio
come out together when it finishes. `configs/tiny-serial.yaml` runs it; it is what the staged
pipeline is compared against (`benchmarks/first_audio.py`), not a way to serve.

Takes the same request payload as the preprocessing stage (`messages` with named audio and image
arrays, `max_tokens`, `temperature`, `speaker`, `talker_max_tokens`); emits one output `{text,
token_ids, pcm, sample_rate_hz, token_time}` and is done.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from realtime_omni.errors import ExecutorError
from realtime_omni.models.qwen3_omni.preprocessing import encode_conversation
from realtime_omni.models.qwen3_omni.processor import load_processor
from realtime_omni.models.qwen3_omni.tensors import model_dtype, setup_torch
from realtime_omni.models.qwen3_omni.tiny import patch_config
from realtime_omni.models.qwen3_omni.weights import model_dir
from realtime_omni.pipeline.executor import Emit, StageContext

Payload = dict[str, Any]
SAMPLE_RATE_HZ = 24000


class SerialExecutor:
    def __init__(self, ctx: StageContext) -> None:
        from transformers import Qwen3OmniMoeForConditionalGeneration

        self.device = setup_torch(ctx.device)
        d = model_dir(ctx.model)
        dtype = model_dtype(ctx.model, ctx.device)
        # Any: transformers wraps `to` with functools.wraps, which mypy does not bind to `model`.
        model: Any = Qwen3OmniMoeForConditionalGeneration.from_pretrained(d, dtype=dtype)
        self.model = model.to(self.device).eval()
        patch_config(self.model.config)
        self.processor = load_processor(d)
        self.max_tokens = int(ctx.params.get("max_tokens", 64))
        self.max_frames = int(ctx.params.get("max_frames", 200))
        self.speaker = str(ctx.params.get("speaker", "ethan"))
        self.todo: dict[str, Payload] = {}

    def add_request(self, request_id: str, inputs: dict[str, Payload]) -> None:
        (payload,) = inputs.values()
        try:  # the processor copies what it keeps out of the borrowed arrays
            inputs, _, _ = encode_conversation(self.processor, payload, "pt")
        except (KeyError, TypeError, ValueError) as e:
            raise ExecutorError(request_id, f"serial: bad request: {e}") from None
        self.todo[request_id] = {
            "inputs": inputs,
            "max_tokens": int(payload.get("max_tokens", self.max_tokens)),
            "sample": float(payload.get("temperature", 0.0)) > 0,
            "speaker": str(payload.get("speaker", self.speaker)),
            "max_frames": int(payload.get("talker_max_tokens", self.max_frames)),
        }

    def add_item(self, request_id: str, src: str, item: Payload) -> None:
        raise ExecutorError(request_id, "the serial stage takes no streamed input")

    def end_stream(self, request_id: str, src: str) -> None:
        pass

    def has_work(self) -> bool:
        return bool(self.todo)

    def abort(self, request_id: str) -> None:
        self.todo.pop(request_id, None)

    @torch.inference_mode()
    def step(self) -> list[Emit]:
        rid, job = next(iter(self.todo.items()))
        del self.todo[rid]
        inputs = job["inputs"].to(self.device)
        t0 = time.monotonic()
        ids, wav = self.model.generate(
            **inputs,
            speaker=job["speaker"].capitalize(),
            return_audio=True,
            thinker_max_new_tokens=job["max_tokens"],
            thinker_eos_token_id=self.model.config.im_end_token_id,
            thinker_do_sample=job["sample"],
            talker_max_new_tokens=job["max_frames"],
            talker_do_sample=job["sample"],
        )
        new = ids[0, inputs["input_ids"].shape[1] :].tolist()
        data = {
            "text": self.processor.tokenizer.decode(new, skip_special_tokens=True),
            "token_ids": np.asarray(new, np.int64),
            "pcm": wav.reshape(-1).float().cpu().numpy() if wav is not None else np.zeros(0),
            "sample_rate_hz": SAMPLE_RATE_HZ,
            "token_time": t0,
        }
        return [Emit(rid, data), Emit(rid, done=True)]
