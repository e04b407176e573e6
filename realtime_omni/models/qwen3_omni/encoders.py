"""The audio_encoder and image_encoder stages: one forward per request, embeddings for the thinker.

AudioEncoderExecutor: `mel` [128, T] and `audio_lengths` [n] in (see preprocessing.py),
`audio_embeds` [Na, D] out. ImageEncoderExecutor: `pixel_values` and `image_grid_thw` in,
`image_embeds` [Ni, D] and `deepstack` [K, Ni, D] out (the features the thinker adds after its
first K layers). A request without audio (or images) passes through as `{n: 0}`.

Batching: the requests waiting at one step (up to the stage's `max_batch`) go through one
forward, their clips (or images) side by side as the towers take several anyway; each clip is
encoded on its own inside the tower (the audio tower's windows and the vision tower's
attention never cross a clip), so the outputs are split back per request by the tokens each
clip makes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
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
        self.max_batch = ctx.max_batch
        self.todo: dict[str, dict[str, Any]] = {}  # request -> its input tensors (and notes)

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
        batch = list(self.todo)[: self.max_batch]
        work = [rid for rid in batch if self.todo[rid]]
        outs = (
            dict(zip(work, self._encode([self.todo[r] for r in work]), strict=True)) if work else {}
        )
        emits = []
        for rid in batch:
            del self.todo[rid]
            emits += [Emit(rid, outs.get(rid, {"n": 0})), Emit(rid, done=True)]
        return emits

    def abort(self, request_id: str) -> None:
        self.todo.pop(request_id, None)

    def _encode(self, batch: list[dict[str, Any]]) -> list[Payload]:
        raise NotImplementedError


class AudioEncoderExecutor(_EncoderExecutor):
    """Every turn carries the conversation's earlier clips again, so the embeddings of the
    clips seen last are kept (by their mel's digest, at most `params.cache_clips`, default 256,
    least recently used out): a clip is encoded once per conversation, not once per turn."""

    part = "audio_encoder"

    def __init__(self, ctx: StageContext) -> None:
        super().__init__(ctx)
        self.cache_clips = int(ctx.params.get("cache_clips", 256))
        self.cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def add_request(self, request_id: str, inputs: dict[str, Payload]) -> None:
        super().add_request(request_id, inputs)
        todo = self.todo[request_id]
        if todo:  # the clips' lengths and digests, from the host arrays: no device round trip
            (payload,) = inputs.values()
            lengths = [int(n) for n in payload["audio_lengths"]]
            clips = np.split(payload["mel"], np.cumsum(lengths)[:-1], axis=1)
            todo["lengths"] = lengths
            todo["clips"] = [hashlib.blake2b(c.tobytes(), digest_size=16).digest() for c in clips]

    def _encode(self, batch: list[dict[str, Any]]) -> list[Payload]:
        todo: dict[bytes, torch.Tensor] = {}  # clips to encode now: digest -> mel
        for b in batch:
            for mel, key in zip(b["mel"].split(b["lengths"], dim=1), b["clips"], strict=True):
                if key not in self.cache:
                    todo[key] = mel
        if todo:
            self._encode_clips(todo)
        out = []
        for keys in (b["clips"] for b in batch):
            for k in keys:
                self.cache.move_to_end(k)
            out.append({"audio_embeds": torch.cat([self.cache[k] for k in keys])})
        while len(self.cache) > self.cache_clips:
            self.cache.popitem(last=False)
        return out

    def _encode_clips(self, todo: dict[bytes, torch.Tensor]) -> None:
        """One tower forward for every new clip, side by side (they never attend across)."""
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            _get_feat_extract_output_lengths,
        )

        mels = list(todo.values())
        lengths = torch.tensor([m.shape[1] for m in mels], device=mels[0].device)
        embeds = self.model(
            torch.cat(mels, dim=1).to(self.dtype), feature_lens=lengths, return_dict=True
        ).last_hidden_state
        made = _get_feat_extract_output_lengths(lengths).tolist()
        for key, e in zip(todo, embeds.split(made), strict=True):
            self.cache[key] = e.clone()  # owned, not a view of the whole batch


class ImageEncoderExecutor(_EncoderExecutor):
    part = "image_encoder"

    def _encode(self, batch: list[dict[str, Any]]) -> list[Payload]:
        pixels = torch.cat([b["pixel_values"] for b in batch]).to(self.dtype)
        grids = torch.cat([b["image_grid_thw"] for b in batch])
        out = self.model(pixels, grid_thw=grids)
        merge = self.model.spatial_merge_size**2
        made = [int(b["image_grid_thw"].prod(-1).sum()) // merge for b in batch]
        embeds = out.pooler_output.split(made)
        deepstack = torch.stack(list(out.deepstack_features)).split(made, dim=1)
        return [
            {"image_embeds": e, "deepstack": ds} for e, ds in zip(embeds, deepstack, strict=True)
        ]
