"""The audio_encoder and image_encoder stages: one forward per request, embeddings for the thinker.

AudioEncoderExecutor: `mel` [128, T] and `audio_lengths` [n] in (see preprocessing.py),
`audio_embeds` [Na, D] out. ImageEncoderExecutor: `pixel_values` and `image_grid_thw` in,
`image_embeds` [Ni, D] and `deepstack` [K, Ni, D] out (the features the thinker adds after its
first K layers). A request without audio (or images) passes through as `{n: 0}`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from realtime_omni.models.qwen3_omni.tensors import model_dtype, setup_torch, to_torch
from realtime_omni.models.qwen3_omni.weights import load_config, load_part, model_dir
from realtime_omni.pipeline.executor import Emit, StageContext

Payload = dict[str, Any]


class _EncoderExecutor:
    part = ""

    def __init__(self, ctx: StageContext) -> None:
        self.device = setup_torch(ctx.device)
        d = model_dir(ctx.model)
        self.dtype = model_dtype(ctx.model, ctx.device)
        self.model = load_part(d, self.part, ctx.device, self.dtype, load_config(d))
        self.todo: dict[str, dict[str, torch.Tensor]] = {}

    def add_request(self, request_id: str, inputs: dict[str, Payload]) -> None:
        (payload,) = inputs.values()
        self.todo[request_id] = {
            k: to_torch(v, self.device) for k, v in payload.items() if isinstance(v, np.ndarray)
        }

    def add_item(self, request_id: str, src: str, item: Payload) -> None:
        pass

    def end_stream(self, request_id: str, src: str) -> None:
        pass

    def has_work(self) -> bool:
        return bool(self.todo)

    def step(self) -> list[Emit]:
        emits = []
        for rid, inputs in self.todo.items():
            emits += [Emit(rid, self._encode(inputs) if inputs else {"n": 0}), Emit(rid, done=True)]
        self.todo.clear()
        return emits

    def abort(self, request_id: str) -> None:
        self.todo.pop(request_id, None)

    def _encode(self, inputs: dict[str, torch.Tensor]) -> Payload:
        raise NotImplementedError


class AudioEncoderExecutor(_EncoderExecutor):
    part = "audio_encoder"

    def _encode(self, inputs: dict[str, torch.Tensor]) -> Payload:
        mel = inputs["mel"].to(self.dtype)
        out = self.model(mel, feature_lens=inputs["audio_lengths"], return_dict=True)
        return {"audio_embeds": out.last_hidden_state}


class ImageEncoderExecutor(_EncoderExecutor):
    part = "image_encoder"

    def _encode(self, inputs: dict[str, torch.Tensor]) -> Payload:
        pixels = inputs["pixel_values"].to(self.dtype)
        out = self.model(pixels, grid_thw=inputs["image_grid_thw"])
        deepstack = torch.stack(list(out.deepstack_features))
        return {"image_embeds": out.pooler_output, "deepstack": deepstack}
