"""The code2wav stage: streamed vocoder, 16-code frames in, 24 kHz float32 PCM chunks out.

Chunking (`ChunkPlan`, pure arithmetic): the first chunk has at most `first_chunk_frames`
(default 2) frames for a fast first packet, each later one as many frames as were sent before it
(2, 2, 4, 8, ...) up to `chunk_frames` (default 10), and the tail whatever is left when the
talker ends.

Decoding (`vocoder.StreamingDecoder`): a chunk of frames [s, e) goes through the pre-transformer
with c = min(left_context_frames, s) frames before it, and only its own frames go on through the
convolutions, which keep per request what they need of the past. The joined stream has exactly
the length and alignment of one call on all frames (n * 1920 - 555 samples: the first chunk
returns 555 fewer than its frames' worth, every later one exactly its frames' worth). The samples
equal that one call to float noise while c reaches back `layers x sliding_window` frames (the
pre-transformer's reach, and the default: 144 frames for the tiny model, 576 for Qwen3-Omni);
with less, they differ slightly (a quality/cost trade-off set by `left_context_frames`: the
pre-transformer is a small part of code2wav's time). Before the convolutions streamed, each
chunk was decoded whole with its context, so a 10-frame chunk with 25 frames of context cost
3.5 chunks.

Batching: the pre-transformer runs once per window length; the convolutions once per length
for first chunks (they start with no past), and for later chunks once per run of lengths
within `MERGE_PAD_FRAMES` of the longest, each padded to it (every layer is causal, so a row's
samples and state are those of its own frames), for up to the stage's `max_batch` chunks.
A step decodes at most `params.max_frames_per_step` new frames (default 64), the chunks of the
listeners who have heard the least first: a new answer's first chunk never waits behind the
others' longer chunks, and a step never holds the talker in the same process up for long.
While a new answer waits for its first chunk (its frames come in a talker step apart), steps
leave out the listeners with at least `params.yield_lead_s` (default 0.2 s, 0: never) of audio
ahead of real time, counted from their first chunk, and the stage would rather wait for the
first chunk's frames than begin a long step: a step costs about its frames, so the first
chunk's step is short, and the others get the next one with audio to spare, or a step of their
own once their lead falls to `yield_lead_s` (`wake_in`). benchmarks/concurrency.py, 16 streams:
leaving them out of the step that makes a first chunk took first audio p99 from 298 to 230 ms
(the median of 12 rounds each), with no more stalls; leaving them out while the first chunk's
frames come in too: benchmarks/README.md, session 17.

Outputs: `{pcm [n] float32, codes [frames, 16] int32, index, frames, token_time, request_id,
sample_rate_hz}`, where `token_time` is that of the chunk's first frame.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from realtime_omni.models.qwen3_omni.tensors import model_dtype, setup_torch
from realtime_omni.models.qwen3_omni.vocoder import State, StreamingDecoder
from realtime_omni.models.qwen3_omni.weights import load_config, load_part, model_dir
from realtime_omni.pipeline.executor import Emit, HoldsRequests, StageContext

Payload = dict[str, Any]
SAMPLE_RATE_HZ = 24000  # in no config: 1920 samples per 80 ms frame
# On a CPU a convolution call over a batch costs ~4 ms plus ~0.6-0.8 ms a frame (tiny model:
# one row of 2 frames 5.5 ms, 4 rows of 10 frames 24 ms): padding a chunk by up to 4 frames to
# share a call is cheaper than a call of its own.
MERGE_PAD_FRAMES = 4


@dataclass(frozen=True)
class ChunkPlan:
    first_chunk_frames: int = 2
    chunk_frames: int = 10
    left_context_frames: int = 144

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
        """First frame the pre-transformer sees for a chunk starting at `start`."""
        return start - min(self.left_context_frames, start)


@dataclass
class _Request:
    frames: list[np.ndarray] = field(default_factory=list)  # [16] codes each
    times: list[float] = field(default_factory=list)
    start: int = 0  # first frame not yet emitted
    chunks: int = 0
    ended: bool = False
    state: State = field(default_factory=dict)  # the convolutions' past (StreamingDecoder)
    samples: int = 0  # PCM samples emitted
    first_at: float | None = None  # when its first chunk was emitted (`clock`)


class Code2WavExecutor(HoldsRequests):
    def __init__(self, ctx: StageContext) -> None:
        self.device = setup_torch(ctx.device)
        d = model_dir(ctx.model)
        cfg = load_config(d)
        self.model = load_part(d, "code2wav", ctx.device, model_dtype(ctx.model, ctx.device), cfg)
        self.decoder = StreamingDecoder(self.model)
        c = self.model.config
        p = ctx.params
        self.plan = ChunkPlan(
            first_chunk_frames=int(p.get("first_chunk_frames", 2)),
            chunk_frames=int(p.get("chunk_frames", 10)),
            left_context_frames=int(
                p.get("left_context_frames", c.num_hidden_layers * c.sliding_window)
            ),
        )
        if self.plan.left_context_frames < 0 or self.plan.first_chunk_frames < 1:
            raise ValueError("code2wav: left_context_frames >= 0 and first_chunk_frames >= 1")
        self.max_batch = ctx.max_batch
        self.max_frames_per_step = int(p.get("max_frames_per_step", 64))
        self.yield_lead_s = float(p.get("yield_lead_s", 0.2))
        self.clock = time.monotonic
        self.reqs: dict[str, _Request] = {}

    def add_request(self, request_id: str, inputs: dict[str, Payload]) -> None:
        self.reqs[request_id] = _Request()

    def add_item(self, request_id: str, src: str, item: Payload) -> None:
        r = self.reqs[request_id]
        r.frames.append(np.array(item["codes"], dtype=np.int64))
        r.times.append(float(item["token_time"]))

    def end_stream(self, request_id: str, src: str) -> None:
        self.reqs[request_id].ended = True

    def has_work(self) -> bool:
        running = self.running().values()
        return any(r.ended and r.start >= len(r.frames) for r in running) or bool(self._serve())

    def wake_in(self) -> float | None:
        """Seconds until a listener left out for a first chunk (`_serve`) runs short."""
        if not self._yielding():
            return None
        now = self.clock()
        running = self.running().values()
        spare = [
            self._ahead_s(r, now) - self.yield_lead_s for r in running if self._due(r) is not None
        ]
        return max(0.0, min(spare)) if spare else None

    def step(self) -> list[Emit]:
        emits: list[Emit] = []
        for rid, r in list(self.running().items()):
            if r.ended and r.start >= len(r.frames):
                del self.reqs[rid]
                emits.append(Emit(rid, done=True))
        due = self._serve()
        # The listeners who have heard the least go first (a new answer's first chunk above all),
        # within `max_frames_per_step` new frames, so that one step never holds up the stages
        # sharing this process (the talker) for long: those who wait have audio queued.
        chosen: list[tuple[str, int]] = []
        frames = 0
        for start, rid, end in sorted(due)[: self.max_batch]:
            if chosen and frames + end - start > self.max_frames_per_step:
                break
            chosen.append((rid, end))
            frames += end - start
        return emits + self._chunks(chosen) if chosen else emits

    def abort(self, request_id: str) -> None:
        self.reqs.pop(request_id, None)

    def _serve(self) -> list[tuple[int, str, int]]:
        """The chunks due, as (frames heard, rid, chunk end). While a new answer waits for its
        first chunk, the listeners with `yield_lead_s` of audio to spare are left out: its
        frames come a talker step apart, and a long step begun in between would hold its first
        chunk up."""
        due = []
        for rid, r in self.running().items():
            end = self._due(r)
            if end is not None:
                due.append((r.start, rid, end))
        if due and self._yielding():
            now = self.clock()
            due = [d for d in due if self._ahead_s(self.reqs[d[1]], now) < self.yield_lead_s]
        return due

    def _yielding(self) -> bool:
        """A new answer has frames in and no chunk out yet."""
        return self.yield_lead_s > 0 and any(
            r.chunks == 0 and r.frames for r in self.running().values()
        )

    @staticmethod
    def _ahead_s(r: _Request, now: float) -> float:
        """Audio a listener has beyond real time since its first chunk (0 before it)."""
        if r.first_at is None:
            return 0.0
        return r.samples / SAMPLE_RATE_HZ - (now - r.first_at)

    def _due(self, r: _Request) -> int | None:
        return self.plan.next_end(r.start, len(r.frames), r.ended)

    def _chunks(self, chosen: list[tuple[str, int]]) -> list[Emit]:
        """The pre-transformer once per window length, then the convolutions once per chunk
        length (first chunks apart), each over the new frames only."""
        windows: dict[int, list[tuple[str, int]]] = {}
        for rid, end in chosen:
            windows.setdefault(end - self.plan.window(self.reqs[rid].start), []).append((rid, end))
        hidden: dict[str, torch.Tensor] = {}
        for group in windows.values():
            codes = [
                np.stack(self.reqs[rid].frames[self.plan.window(self.reqs[rid].start) : end], 1)
                for rid, end in group
            ]
            h = self.decoder.hidden(torch.from_numpy(np.stack(codes)).to(self.device))
            for (rid, end), row in zip(group, h, strict=True):
                hidden[rid] = row[row.shape[0] - (end - self.reqs[rid].start) :]
        emits = []
        for first, group in self._calls(chosen):
            rows = [self.reqs[rid] for rid, _ in group]
            frames = [end - r.start for (_, end), r in zip(group, rows, strict=True)]
            t = max(frames)
            pad = [
                hidden[rid] if n == t else F.pad(hidden[rid], (0, 0, 0, t - n))
                for (rid, _), n in zip(group, frames, strict=True)
            ]
            wavs = self.decoder.decode(
                torch.stack(pad), [r.state for r in rows], None if first else frames
            )
            per_frame = wavs.shape[1] // t
            wavs_np = wavs.float().cpu().numpy()
            for (rid, end), r, wav, n in zip(group, rows, wavs_np, frames, strict=True):
                emits += self._emit(rid, r, end, wav if first else wav[: n * per_frame])
        return emits

    def _calls(self, chosen: list[tuple[str, int]]) -> list[tuple[bool, list[tuple[str, int]]]]:
        """The convolutions' calls: first chunks by length (they start with no past); later
        chunks longest first, each joining the call before when it is at most
        `MERGE_PAD_FRAMES` shorter than that call's longest (padded to it: a call of its own
        would cost 5-7 frames' work more)."""
        firsts: dict[int, list[tuple[str, int]]] = {}
        later: list[tuple[int, str, int]] = []
        for rid, end in chosen:
            s = self.reqs[rid].start
            if s == 0:
                firsts.setdefault(end, []).append((rid, end))
            else:
                later.append((end - s, rid, end))
        calls = [(True, group) for group in firsts.values()]
        longest = 0
        for n, rid, end in sorted(later, key=lambda c: -c[0]):
            if not calls or calls[-1][0] or longest - n > MERGE_PAD_FRAMES:
                calls.append((False, []))
                longest = n
            calls[-1][1].append((rid, end))
        return calls

    def _emit(self, rid: str, r: _Request, end: int, pcm: np.ndarray) -> list[Emit]:
        s = r.start
        data = {
            "pcm": pcm,
            "codes": np.stack(r.frames[s:end]).astype(np.int32),
            "index": r.chunks,
            "frames": end - s,
            "token_time": r.times[s],
            "request_id": rid,
            "sample_rate_hz": SAMPLE_RATE_HZ,
        }
        r.chunks += 1
        r.samples += pcm.shape[0]
        if r.first_at is None:
            r.first_at = self.clock()
        r.start = end
        # Frames before the next chunk's window are never read again.
        for i in range(self.plan.window(end)):
            r.frames[i] = _EMPTY
        emits = [Emit(rid, data)]
        if r.ended and r.start >= len(r.frames):
            del self.reqs[rid]
            emits.append(Emit(rid, done=True))
        return emits


_EMPTY = np.zeros(0, np.int64)
