"""The audio_encoder and image_encoder stages: one forward per request, embeddings for the thinker.

AudioEncoderExecutor: `mel` [128, T] and `audio_lengths` [n] in (see preprocessing.py),
`audio_embeds` [Na, D] out. ImageEncoderExecutor: `pixel_values` and `image_grid_thw` in,
`image_embeds` [Ni, D] and `deepstack` [K, Ni, D] out (the features the thinker adds after its
first K layers). A request without audio (or images) passes through as `{n: 0}`.

Batching: the requests waiting at one step (up to the stage's `max_batch`) go through one
forward, their audio windows (or images) side by side as the towers take several anyway;
nothing attends across a window (or an image), so the outputs are split back by the tokens
each makes.
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
        self.shares: dict[str, float] = {}  # what the last step computed for each request

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
        self.shares = {}
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
    """Audio in the tower's own windows, each encoded once and kept.

    The tower cuts a clip's mel into chunks of `2 x n_window` frames (1 s) from the clip's
    start, convolves each chunk alone (its positions restart at every chunk) and attends only
    within windows of `n_window_infer` frames (8 s in Qwen3-Omni) from the clip's start. A
    window's outputs thus depend on its own frames alone: encoding a clip window by window, each
    window a clip of its own side by side, gives the whole clip's outputs (to the bit on a CPU:
    tests/models/test_prefill_while_speaking.py). Every turn carries the conversation's earlier
    audio again, and prefill while speaking sends a turn's audio again with more appended, so
    each window's embeddings are kept by the digest of its mel frames (at most
    `params.cache_windows`, default 512, least recently used out): a clip is encoded once per
    conversation, and a growing one encodes its new windows and its last, partial, window again.

    What stays the same is decided by the features, so reuse is exact, never approximate: the
    feature extractor floors a clip's log-mel at its maximum minus 8 (80 dB), so audio louder
    than all before it changes every floored value of the clip, and a clip's last frames see its
    end (reflected, or zeros when another clip of the request is longer). A window whose
    features changed has another digest and is encoded again. Windows of 8 s mean a turn
    shorter than that reuses none of its own audio: its prefix ends where its audio begins.
    """

    part = "audio_encoder"

    def __init__(self, ctx: StageContext) -> None:
        super().__init__(ctx)
        cfg = self.model.config
        chunk = 2 * cfg.n_window
        self.window_frames = max(1, cfg.n_window_infer // chunk) * chunk
        self.cache_windows = int(ctx.params.get("cache_windows", 512))
        self.cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def add_request(self, request_id: str, inputs: dict[str, Payload]) -> None:
        super().add_request(request_id, inputs)
        todo = self.todo[request_id]
        if todo:  # the windows' places and digests, from the host arrays: no device round trip
            (payload,) = inputs.values()
            mel = payload["mel"]
            windows = []  # (digest, first frame in `mel`, frames)
            start = 0
            for n in (int(x) for x in payload["audio_lengths"]):
                for a in range(start, start + n, self.window_frames):
                    b = min(start + n, a + self.window_frames)
                    key = hashlib.blake2b(mel[:, a:b].tobytes(), digest_size=16).digest()
                    windows.append((key, a, b - a))
                start += n
            todo["windows"] = windows
            todo["request_id"] = request_id

    def step_shares(self) -> dict[str, float]:
        """Audio tokens encoded for each request in the last step (a window two requests
        needed counts half to each); kept windows cost nothing."""
        return self.shares

    def _encode(self, batch: list[dict[str, Any]]) -> list[Payload]:
        todo: dict[bytes, torch.Tensor] = {}  # windows to encode now: digest -> mel
        wanted: dict[bytes, int] = {}  # how many requests of the step need each
        for b in batch:
            for key, a, n in b["windows"]:
                if key not in self.cache:
                    todo.setdefault(key, b["mel"][:, a : a + n])
                    wanted[key] = wanted.get(key, 0) + 1
        made = self._encode_windows(todo) if todo else {}
        out = []
        for b in batch:
            for key, _, _ in b["windows"]:
                self.cache.move_to_end(key)
            out.append({"audio_embeds": torch.cat([self.cache[k] for k, _, _ in b["windows"]])})
            rid = b["request_id"]
            self.shares[rid] = sum(made[k] / wanted[k] for k, _, _ in b["windows"] if k in made)
        while len(self.cache) > self.cache_windows:
            self.cache.popitem(last=False)
        return out

    def _encode_windows(self, todo: dict[bytes, torch.Tensor]) -> dict[bytes, int]:
        """One tower forward for every new window, each as a clip of its own, side by side
        (they never attend across); gives the tokens each made."""
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
        return dict(zip(todo, made, strict=True))


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
