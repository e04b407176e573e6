"""The code2wav stage: streamed vocoder, 16-code frames in, 24 kHz float32 PCM chunks out.

Chunking (`ChunkPlan`, pure arithmetic): the first chunk has at most `first_chunk_frames`
(default 2) frames for a fast first packet, each later one as many frames as were sent before it
(2, 2, 4, 8, ...) up to `chunk_frames` (default 10), and the tail whatever is left when the
talker ends. A chunk of frames [s, e) is decoded together with
c = min(left_context_frames, s) frames before it. One code2wav call on n frames returns
n * 1920 - 555 samples (its causal transposed convolutions cut 555 at the end), covering absolute
samples [1920 (s - c), 1920 e - 555). The chunk emits from absolute sample 1920 s - 555 (0 for
the first), i.e. it fills the 555 samples its predecessor could not produce: the joined stream has
exactly the length and alignment of one call on all frames, with no sample dropped or repeated.
The samples equal that one call to float noise once c >= layers * sliding_window; with less
context they differ slightly (a quality/latency trade-off set by `left_context_frames`).

Batching: the chunks due in one step whose windows (left context plus chunk) have the same
number of frames are decoded in one call, up to the stage's `max_batch` (every first chunk of
`first_chunk_frames`, and every full later chunk once its context is full, share a shape).
A step decodes at most `params.max_frames_per_step` frames (default 160, context included), the
chunks of the listeners who have heard the least first: a new answer's first chunk never waits
behind the others' longer chunks, and a step never holds the talker in the same process up for
long (16 answers' 20-frame chunks with their context came to 0.4 s of CPU in one step).

Outputs: `{pcm [n] float32, codes [frames, 16] int32, index, frames, token_time, request_id,
sample_rate_hz}`, where `token_time` is that of the chunk's first frame.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from realtime_omni.models.qwen3_omni.tensors import model_dtype, setup_torch
from realtime_omni.models.qwen3_omni.weights import load_config, load_part, model_dir
from realtime_omni.pipeline.executor import Emit, HoldsRequests, StageContext

Payload = dict[str, Any]
SAMPLE_RATE_HZ = 24000  # in no config: 1920 samples per 80 ms frame


@dataclass(frozen=True)
class ChunkPlan:
    samples_per_frame: int = 1920
    lost_tail: int = 555  # samples one call cuts at its end
    first_chunk_frames: int = 2
    chunk_frames: int = 10
    left_context_frames: int = 25

    def size(self, start: int) -> int:
        """Frames of the chunk starting at `start`: `first_chunk_frames`, then as many as were
        emitted before it (doubling), up to `chunk_frames`. The audio already sent is what the
        listener hears while the next chunk is made, so a chunk never asks for more frames than
        that covers: 2, 2, 4, 8, 10, 10, ... A fixed second chunk of 10 frames left the
        listener 50 ms of silence after the first with one stream and 340 ms with 16
        (benchmarks/concurrency.py, worst_stall_ms)."""
        return min(self.chunk_frames, max(self.first_chunk_frames, start))

    def next_end(self, start: int, available: int, final: bool) -> int | None:
        """End frame of the chunk starting at `start`, or None while it must wait for frames."""
        size = self.size(start)
        if available - start >= size:
            return start + size
        if final and available > start:
            return available
        return None

    def window(self, start: int) -> int:
        """First frame to decode for a chunk starting at `start` (its left context)."""
        return start - min(self.left_context_frames, start)

    def trim(self, start: int) -> int:
        """Samples to drop from the front of the call's output for a chunk starting at `start`."""
        if start == 0:
            return 0
        return (start - self.window(start)) * self.samples_per_frame - self.lost_tail


@dataclass
class _Request:
    frames: list[np.ndarray] = field(default_factory=list)  # [16] codes each
    times: list[float] = field(default_factory=list)
    start: int = 0  # first frame not yet emitted
    chunks: int = 0
    ended: bool = False


class Code2WavExecutor(HoldsRequests):
    def __init__(self, ctx: StageContext) -> None:
        self.device = setup_torch(ctx.device)
        d = model_dir(ctx.model)
        cfg = load_config(d)
        self.model = load_part(d, "code2wav", ctx.device, model_dtype(ctx.model, ctx.device), cfg)
        p = ctx.params
        self.plan = ChunkPlan(
            samples_per_frame=int(self.model.total_upsample),
            lost_tail=self._lost_tail(),
            first_chunk_frames=int(p.get("first_chunk_frames", 2)),
            chunk_frames=int(p.get("chunk_frames", 10)),
            left_context_frames=int(p.get("left_context_frames", 25)),
        )
        if self.plan.left_context_frames < 1 or self.plan.first_chunk_frames < 1:
            raise ValueError("code2wav: left_context_frames and first_chunk_frames must be >= 1")
        self.max_batch = ctx.max_batch
        self.max_frames_per_step = int(p.get("max_frames_per_step", 160))
        self.reqs: dict[str, _Request] = {}

    def _lost_tail(self) -> int:
        """Measured once: samples per frame times 2 frames minus what one 2-frame call returns."""
        codes = torch.zeros(1, self.model.config.num_quantizers, 2, dtype=torch.long)
        n = self.model(codes.to(self.device)).shape[-1]
        return int(2 * self.model.total_upsample - n)

    def add_request(self, request_id: str, inputs: dict[str, Payload]) -> None:
        self.reqs[request_id] = _Request()

    def add_item(self, request_id: str, src: str, item: Payload) -> None:
        r = self.reqs[request_id]
        r.frames.append(np.array(item["codes"], dtype=np.int64))
        r.times.append(float(item["token_time"]))

    def end_stream(self, request_id: str, src: str) -> None:
        self.reqs[request_id].ended = True

    def has_work(self) -> bool:
        return any(self._due(r) is not None or r.ended for r in self.running().values())

    def step(self) -> list[Emit]:
        emits: list[Emit] = []
        due: list[tuple[int, str, int, int]] = []  # (frames heard, rid, chunk end, window frames)
        for rid, r in list(self.running().items()):
            end = self._due(r)
            if end is not None:
                due.append((r.start, rid, end, end - self.plan.window(r.start)))
            elif r.ended and r.start >= len(r.frames):
                del self.reqs[rid]
                emits.append(Emit(rid, done=True))
        # The listeners who have heard the least go first (a new answer's first chunk above all),
        # within `max_frames_per_step` decoded frames, so that one step never holds up the
        # stages sharing this process (the talker) for long: those who wait have audio queued.
        groups: dict[int, list[tuple[str, int]]] = {}
        frames = 0
        for _, rid, end, window in sorted(due)[: self.max_batch]:
            if groups and frames + window > self.max_frames_per_step:
                break
            groups.setdefault(window, []).append((rid, end))
            frames += window
        for group in groups.values():
            emits += self._chunks(group)
        return emits

    def abort(self, request_id: str) -> None:
        self.reqs.pop(request_id, None)

    def _due(self, r: _Request) -> int | None:
        return self.plan.next_end(r.start, len(r.frames), r.ended)

    def _chunks(self, group: list[tuple[str, int]]) -> list[Emit]:
        """One code2wav call for chunks whose windows have the same length."""
        windows = []
        for rid, end in group:
            r = self.reqs[rid]
            windows.append(np.stack(r.frames[self.plan.window(r.start) : end], axis=1))
        wavs = self.model(torch.from_numpy(np.stack(windows)).to(self.device))[:, 0]
        pcm = wavs.float().cpu().numpy()
        emits = []
        for (rid, end), wav in zip(group, pcm, strict=True):
            r = self.reqs[rid]
            s = r.start
            data = {
                "pcm": wav[self.plan.trim(s) :],
                "codes": np.stack(r.frames[s:end]).astype(np.int32),
                "index": r.chunks,
                "frames": end - s,
                "token_time": r.times[s],
                "request_id": rid,
                "sample_rate_hz": SAMPLE_RATE_HZ,
            }
            r.chunks += 1
            r.start = end
            # Frames before the next chunk's left context are never read again.
            for i in range(self.plan.window(end)):
                r.frames[i] = _EMPTY
            emits.append(Emit(rid, data))
            if r.ended and r.start >= len(r.frames):
                del self.reqs[rid]
                emits.append(Emit(rid, done=True))
        return emits


_EMPTY = np.zeros(0, np.int64)
