"""Simulated executors: correctly shaped payloads after a configured time per step, so a whole
model graph runs on a CPU with GPU-like timings (`configs/simulated-qwen3-omni.yaml`).

One class, four roles, chosen by `params.role`. A step serves up to the stage's `max_batch`
requests together, as a batched GPU step would, and costs what such a step costs: a part that
does not depend on the batch (reading the weights) plus a part per request (or per item):

- transform: one input set -> one output per downstream stage (preprocessing, encoders); the
  requests waiting together form one step costing `first_step_ms` + `per_request_ms` for each
  request after the first (default: `first_step_ms` again, no gain from batching);
- generate: one input set -> a stream of `items` outputs (or the request's `max_tokens`), one
  per step (the thinker). A decode step costs `step_ms` + `per_request_ms` x decoding requests.
  A new request's prefill of `prompt_tokens` costs `first_step_ms` in all and runs in chunks of
  the stage's `max_prefill_tokens_per_step` beside the decode rows (chunk cost pro rata), so a
  new turn delays the others by one chunk per step, not by a whole prefill. Each decoding row
  also costs `per_context_token_ms` per token it attends to (its prompt and what it made: the
  KV cache a decode step reads); a step of prefill chunks alone costs at least `step_ms` (its
  forward reads every weight, as a decode step does). A `prefill_only` request prefills and
  ends without an item (its downstream streams end empty: the talker and vocoder do nothing);
- follow: a streamed input -> `per_input` outputs per input item (the talker); it never runs
  ahead of its input, and with `output_needs_input` output k waits for input k while the input
  stream is open (the real talker's frame k takes thinker token k's text; after the text ends it
  goes on alone). A step costs `step_ms` + `per_request_ms` x requests past their first output
  + `per_context_token_ms` x their context (`prompt_tokens` and the outputs made), plus
  `first_step_ms` (prefill) for each request making its first;
- chunk: a streamed input -> one output per chunk of input items, `first_chunk` items first,
  then `chunk` (code2wav, text decode); a step costs `base_ms` + `step_ms` x the items of every
  chunk in it + `longest_ms` x the items of its longest chunk (a batched vocoder's time grows
  with the frames it decodes for each stream, and less with the streams).

Conversation payloads (`messages` with audio, from the gateway) are charged by what they hold
(sim_prompt.py): preprocessing with `audio_window_frames` reads the user turn's audio as the
audio encoder's windows; an audio encoder with `per_token_ms` charges per token of the windows it
has not encoded before (`cache_windows` kept), so a turn sent again with more audio pays its new
windows and its last, partial, one again; a thinker's prompt is then `context_tokens`, the
turn's audio tokens and `image_tokens` (when the conversation carries an image; none for a
prefill-only request), and with `session_id` a request prefills only what follows the prefix its
session's last request left (its prompt, or the part an abort cut short), as the real thinker's
kept rows; a follow stage (the talker) with `context_tokens` prefills the same prompt the same
way, at its own `first_step_ms` per `prompt_tokens`, as the real talker's kept rows. A request
waits while a prefill-only request of its session still prefills. A synthetic payload (no
`messages`) costs the fixed figures above.

Floors at a source's figures: a conversation's first prefill (no kept prefix) costs at least
`min_prefill_ms` (generate, follow); an encoder step with windows to encode at least
`min_step_ms` (transform with `per_token_ms`). `gpu` names the GPU the real stage shares with
others: stages naming the same one share its time (`sim_device.py`: k stepping together each
advance at 1/k of their speed), in stage processes (the run's folder holds the device's slots).

Every step says what it cost for each request (`step_shares`: a batch's fixed part split
evenly), so a request's `compute_s` (`pipeline/meter.py`) is what it made the stages do,
an aborted one's included.

A chunk stage with `speech_text` (or `speech_wav`, a 16-bit mono WAV) speaks: its float outputs
to the client carry consecutive 24 kHz samples of that speech, looped, each request from the
start, instead of the tone, so the simulated bot sounds like a voice (echo and turn-taking
tests need one). `speech_text` is spoken by espeak-ng once and kept under `.cache/`.

`serial: true` makes follow and chunk wait until their input stream ended (and a chunk stage
then emits everything as one chunk): the serial baseline, as `generate()` runs the thinker to its
end, then the talker, then one vocoder pass.

`outputs` maps a downstream stage (or `"*"`) to the arrays it gets: `{name: [dtype, shape]}`,
where a shape entry "n" stands for the items in the chunk; float arrays hold a quiet 220 Hz tone
(at 24 kHz), others ones. Every output carries `token_time` (the monotonic time of the generated
item it derives from) and `index`; generated items carry a made-up word as `text`, which chunks
pass on joined. Time passes in `time.sleep`, so a simulated stage does not load the CPU.

A stage placed on a cuda device (torch needed) gives other stages its arrays as CUDA tensors, so
edges between cuda stages carry them by CUDA IPC (a CPU stage gets them as numpy: the runtime
copies them to the host); its outputs to the caller are host arrays from the start.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from realtime_omni.errors import ConfigError
from realtime_omni.pipeline.executor import Emit, StageContext
from realtime_omni.pipeline.messages import CLIENT
from realtime_omni.pipeline.relay import dtype_of
from realtime_omni.pipeline.sim_device import SharedDevice
from realtime_omni.pipeline.sim_prompt import (
    Block,
    has_image,
    prompt_blocks,
    shared_tokens,
    truncated,
    turn_windows,
)

Payload = dict[str, Any]
ROLES = ("transform", "generate", "follow", "chunk")
# Sessions whose kept prefix a simulated thinker remembers, least recently used out (the real
# one is bounded by tokens and KV blocks; a simulated prefix costs a few bytes).
MAX_SESSIONS = 4096
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "simulated",
    "stages",
    "keep",
    "time",
]


@dataclass
class _Req:
    meta: dict[str, Any]
    total: int | None = None  # items to make (generate), known at start
    made: int = 0
    inputs: list[float] = field(default_factory=list)  # token_time of each input item
    texts: list[str] = field(default_factory=list)  # the `text` of each input item, if any
    ended: bool = False
    first_done: bool = False
    prefilled: int = 0  # prompt tokens prefilled so far (generate), the kept prefix included
    prompt: int = 0  # prompt tokens (generate)
    blocks: list[Block] | None = None  # the prompt as the payload describes it (sim_prompt.py)
    cached: int = 0  # prompt tokens its session's kept prefix held
    rate: float = 0.0  # seconds per prompt token of its prefill (floored: `min_prefill_ms`)
    started: bool = False  # its prefill began: it took its session's kept prefix
    held: bool = False  # its outputs wait for credit: make nothing for it
    spoken: int = 0  # samples of the speech given so far (a speaking chunk stage)


class SimulatedExecutor:
    def __init__(self, ctx: StageContext) -> None:
        p = ctx.params
        self.stage = ctx.stage
        self.role = p.get("role", "transform")
        if self.role not in ROLES:
            raise ConfigError(
                f"stages.{ctx.stage}.params.role = {self.role!r}: unknown. Fix: one of {ROLES}"
            )
        self.step_s = float(p.get("step_ms", 0.0)) / 1000
        self.first_step_s = float(p.get("first_step_ms", p.get("step_ms", 0.0))) / 1000
        per_request = p.get("per_request_ms", 0.0 if self.role != "transform" else None)
        self.per_request_s = self.first_step_s if per_request is None else float(per_request) / 1000
        self.base_s = float(p.get("base_ms", 0.0)) / 1000
        self.longest_s = float(p.get("longest_ms", 0.0)) / 1000
        self.context_s = float(p.get("per_context_token_ms", 0.0)) / 1000
        self.needs_input = bool(p.get("output_needs_input", False))
        self.prompt_tokens = max(1, int(p.get("prompt_tokens", 1)))
        self.max_batch = ctx.max_batch
        self.prefill_budget = ctx.max_prefill_tokens_per_step
        self.items = int(p.get("items", 16))
        self.per_input = float(p.get("per_input", 1.0))
        self.first_chunk = int(p.get("first_chunk", 1))
        self.chunk = int(p.get("chunk", 1))
        self.serial = bool(p.get("serial", False))
        if self.serial and self.role == "chunk":
            self.first_chunk = self.chunk = 1 << 30
        self.targets = ctx.downstream
        # generate: the target that speaks (the talker); a `text_only` request skips it
        self.speech_to = p.get("speech_to")
        self.device = ctx.device
        if self.device.startswith("cuda"):
            from realtime_omni.pipeline.cuda_ipc import missing

            if (why := missing(self.device)) is not None:
                raise ConfigError(
                    f"stages.{ctx.stage}.device = {self.device!r}: {why}. Fix: place the stage "
                    "on cpu, or run it on a machine with that GPU"
                )
        self.outputs: dict[str, dict[str, tuple[str, list[Any]]]] = p.get("outputs", {})
        self.speech = _speech(ctx.stage, p) if self.role == "chunk" else None
        # A conversation payload's prompt (sim_prompt.py): preprocessing reads the turn's audio
        # windows (`audio_window_frames`); the audio encoder charges `per_token_ms` per token of
        # the windows it has not encoded yet (keeping `cache_windows`); the thinker prefills
        # `context_tokens`, the audio and `image_tokens`, past its session's kept prefix.
        self.window_frames = int(p.get("audio_window_frames", 0))
        self.per_token_s = float(p.get("per_token_ms", 0.0)) / 1000
        self.cache_windows = int(p.get("cache_windows", 512))
        self.context_tokens = int(p.get("context_tokens", self.prompt_tokens))
        self.image_tokens = int(p.get("image_tokens", 0))
        # A conversation with no image (a call without a camera; a prefill-only request, which
        # leaves out what follows the turn's audio): an image encoder with this set does
        # nothing for it, as the real one given no patches.
        self.skip_without_image = bool(p.get("skip_without_image", False))
        # Floors at the source's figures: a conversation's first prefill (no kept prefix) costs
        # at least `min_prefill_ms`; an encoder step with windows to encode at least
        # `min_step_ms` (+ `per_request_ms` per further request with windows to encode).
        self.min_prefill_s = float(p.get("min_prefill_ms", 0.0)) / 1000
        self.min_step_s = float(p.get("min_step_ms", 0.0)) / 1000
        # `gpu`: the GPU its real stage shares with others (sim_device.py): their steps share
        # its time. In a stage process only (the run's folder holds the device's slots).
        gpu = p.get("gpu")
        self.gpu = SharedDevice(ctx.run_dir, str(gpu)) if gpu is not None and ctx.run_dir else None
        self.windows: OrderedDict[str, None] = OrderedDict()  # encoded audio windows
        self.sessions: OrderedDict[str, list[Block]] = OrderedDict()  # kept prompt prefixes
        self.shares: dict[str, float] = {}  # seconds of the last step's cost, per request
        self.reqs: dict[str, _Req] = {}
        self._arrays: dict[tuple[str, str, str], Any] = {}  # numpy arrays, CUDA tensors

    # ---- executor contract ---------------------------------------------------------------

    def add_request(self, request_id: str, inputs: dict[str, Payload]) -> None:
        meta: dict[str, Any] = {}
        for payload in inputs.values():
            meta.update({k: v for k, v in payload.items() if not isinstance(v, np.ndarray)})
            if self.window_frames and (windows := turn_windows(payload, self.window_frames)):
                meta["audio_windows"] = windows
                meta["image"] = has_image(payload)
        r = _Req(meta=meta)
        if self.role == "generate":
            r.total = 0 if meta.get("prefill_only") else int(meta.get("max_tokens", self.items))
        if self.role in ("generate", "follow"):
            r.prompt = self.prompt_tokens
            if "audio_windows" in meta:
                image = self.image_tokens if meta.get("image") else 0
                r.blocks = prompt_blocks(
                    [(str(d), int(n)) for d, n in meta["audio_windows"]], self.context_tokens, image
                )
                r.prompt = sum(n for _, n in r.blocks)
        self.reqs[request_id] = r

    def add_item(self, request_id: str, src: str, item: Payload) -> None:
        r = self.reqs[request_id]
        r.inputs.append(float(item.get("token_time", time.monotonic())))
        r.texts.append(str(item.get("text", "")))

    def end_stream(self, request_id: str, src: str) -> None:
        self.reqs[request_id].ended = True

    def abort(self, request_id: str) -> None:
        self._release(request_id)

    def _release(self, request_id: str) -> None:
        """Drop the request; a session's leaves what its prefill computed for the next."""
        r = self.reqs.pop(request_id, None)
        session = r.meta.get("session_id") if r is not None else None
        if r is None or r.blocks is None or not r.started or not session:
            return
        self.sessions[str(session)] = truncated(r.blocks, r.prefilled)
        self.sessions.move_to_end(str(session))
        while len(self.sessions) > MAX_SESSIONS:
            self.sessions.popitem(last=False)

    def step_shares(self) -> dict[str, float]:
        """What the last step cost for each request (its fixed part split evenly)."""
        return self.shares

    def hold(self, request_id: str, held: bool) -> None:
        if request_id in self.reqs:
            self.reqs[request_id].held = held

    def has_work(self) -> bool:
        return any(self._due(r) for r in self.reqs.values())

    def step(self) -> list[Emit]:
        emits: list[Emit] = []
        self.shares = {}
        for rid, r in list(self.reqs.items()):
            if self.role in ("follow", "chunk") and r.ended and not r.inputs:
                del self.reqs[rid]  # its input ended empty (a text-only answer): no work
                emits.append(Emit(rid, done=True))
        batch = [rid for rid, r in self.reqs.items() if self._due(r)][: self.max_batch]
        if self.role == "generate":
            batch, cost = self._generate_batch(batch)
        else:
            cost = self._cost(batch)
        if self.gpu is not None:
            self.gpu.spend(cost)
        else:
            time.sleep(cost)
        for rid in batch:
            emits += self._produce(rid)
        return emits

    def _generate_batch(self, batch: list[str]) -> tuple[list[str], float]:
        """Decode rows and prefill chunks of one step: who emits, and what the step costs.
        A prefill chunk costs `first_step_ms` pro rata per token of `prompt_tokens` (a first
        pass at least `min_prefill_ms` in all); the tokens a session's kept prefix holds cost
        nothing. A step's forward reads every weight,
        so a step of prefill chunks alone costs at least `step_ms`, as a decode step does."""
        decoding = [rid for rid in batch if self.reqs[rid].first_done]
        fixed = self.step_s / len(decoding) if decoding else 0.0
        for rid in decoding:
            r = self.reqs[rid]
            self.shares[rid] = fixed + self.per_request_s + self.context_s * (r.prompt + r.made)
        budget = self.prefill_budget
        filling: set[str] = set()  # sessions with a prefill-only request still prefilling
        prefilling = []
        for rid in batch:
            r = self.reqs[rid]
            session = r.meta.get("session_id")
            if r.first_done or session in filling:  # a later request takes that prefix
                continue
            if r.meta.get("prefill_only") and session:
                filling.add(session)
            if budget <= 0:
                continue
            if not r.started:
                self._take_prefix(r)
            chunk = min(budget, r.prompt - r.prefilled)
            budget -= chunk
            r.prefilled += chunk
            self.shares[rid] = r.rate * chunk
            prefilling.append(rid)
        if prefilling and not decoding:
            short = self.step_s - sum(self.shares.values())
            for rid in prefilling:
                self.shares[rid] += max(0.0, short) / len(prefilling)
        # a prefill that ends gives its first token in this step
        decoding += [rid for rid in prefilling if self.reqs[rid].prefilled >= self.reqs[rid].prompt]
        return decoding, sum(self.shares.values())

    def _follow_prefill(self, r: _Req) -> float:
        """A follow stage's (the talker's) prefill, whole in its first step: `first_step_ms` for
        a synthetic request; a conversation's, pro rata per token of its prompt past its
        session's kept prefix (as the thinker's; a first pass at least `min_prefill_ms`), never
        less than a step."""
        if r.blocks is None:
            return self.first_step_s
        self._take_prefix(r)
        new = r.prompt - r.prefilled
        r.prefilled = r.prompt
        return max(self.step_s, r.rate * new)

    def _take_prefix(self, r: _Req) -> None:
        """At its prefill's start, a request takes its session's kept prefix (as the real
        thinker takes the kept row: it is no longer kept for another)."""
        r.started = True
        session = r.meta.get("session_id")
        kept = self.sessions.pop(str(session), None) if session else None
        if kept is not None and r.blocks is not None:
            r.cached = r.prefilled = max(0, shared_tokens(kept, r.blocks))
        r.rate = self.first_step_s / self.prompt_tokens
        if not r.cached and (new := r.prompt - r.prefilled) > 0:  # its conversation's first pass
            r.rate = max(r.rate, self.min_prefill_s / new)

    # ---- roles ---------------------------------------------------------------------------

    def _due(self, r: _Req) -> int:
        """How many input items the next output of this request consumes (0: nothing to do)."""
        if r.held:
            return 0
        if self.serial and not r.ended and self.role in ("follow", "chunk"):
            return 0
        if self.role == "transform":
            return 1
        if self.role == "generate":
            return 1 if r.made < (r.total or 0) or not r.first_done else 0
        if self.role == "follow":
            allowed = len(r.inputs) * self.per_input
            if self.needs_input and not r.ended:
                allowed = min(allowed, len(r.inputs))
            target = math.ceil(allowed) if r.ended else math.floor(allowed)
            return 1 if r.made < target or (r.ended and not r.first_done) else 0
        size = self.first_chunk if r.made == 0 else self.chunk
        left = len(r.inputs) - self._consumed(r)
        if left >= size:
            return size
        return max(left, 1) if r.ended else 0

    def _consumed(self, r: _Req) -> int:
        if r.made == 0:
            return 0
        return self.first_chunk + (r.made - 1) * self.chunk

    def _cost(self, batch: list[str]) -> float:
        """What a step of `batch` costs (see the module docstring), each request's part in
        `shares`: a batch's fixed cost split evenly."""
        reqs = {rid: self.reqs[rid] for rid in batch}
        if not reqs:
            return 0.0
        if self.role == "chunk":
            items = {rid: self._due(r) for rid, r in reqs.items()}
            fixed = (self.base_s + self.longest_s * max(items.values())) / len(reqs)
            for rid, n in items.items():
                self.shares[rid] = fixed + self.step_s * n
        elif self.role == "transform":
            self._transform_cost(reqs)
        else:
            following = [rid for rid, r in reqs.items() if r.first_done]
            fixed = self.step_s / len(following) if following else 0.0
            for rid, r in reqs.items():
                if not r.first_done:
                    self.shares[rid] = self._follow_prefill(r)
                    continue
                context = self.context_s * (self.prompt_tokens + r.made)
                self.shares[rid] = fixed + self.per_request_s + context
        return sum(self.shares.values())

    def _transform_cost(self, reqs: dict[str, _Req]) -> None:
        """`first_step_ms` for a step's first request and `per_request_ms` for each other; with
        `per_token_ms`, a request whose turn's audio windows are known pays per token of those
        not encoded before (a window two requests of the step need, half each); the requests with
        a window to encode pay at least `min_step_ms` together (and `per_request_ms` for each
        after the first), in proportion: a pass of the encoder costs at least that."""
        plain = []
        todo: dict[str, int] = {}  # windows to encode in this step: digest -> requests needing it
        passes = []  # requests with a window to encode: each is a pass of the encoder
        for rid, r in reqs.items():
            windows = r.meta.get("audio_windows") if self.per_token_s else None
            if self.skip_without_image and r.meta.get("image") is False:
                self.shares[rid] = 0.0  # a conversation with no image: nothing to encode
            elif windows is None:
                plain.append(rid)
            else:
                if any(d not in self.windows for d, _ in windows):
                    passes.append(rid)
                for d, _ in windows:
                    if d not in self.windows:
                        todo[d] = todo.get(d, 0) + 1
        if plain:
            part = (self.first_step_s + self.per_request_s * (len(plain) - 1)) / len(plain)
            self.shares.update(dict.fromkeys(plain, part))
        for rid, r in reqs.items():
            if rid in self.shares:
                continue
            windows = r.meta["audio_windows"]
            self.shares[rid] = sum(self.per_token_s * n / todo[d] for d, n in windows if d in todo)
            for d, _ in windows:
                self.windows[d] = None
                self.windows.move_to_end(d)
        floor = self.min_step_s + self.per_request_s * (len(passes) - 1) if passes else 0.0
        if self.min_step_s and floor > (paid := sum(self.shares[rid] for rid in passes)):
            for rid in passes:  # raised to the floor, each in proportion to its windows
                self.shares[rid] = self.shares[rid] * floor / paid
        while len(self.windows) > self.cache_windows:
            self.windows.popitem(last=False)

    def _produce(self, rid: str) -> list[Emit]:
        r = self.reqs[rid]
        r.first_done = True
        if self.role == "transform":
            del self.reqs[rid]
            return [*self._emits(rid, r.meta, 1), Emit(rid, done=True)]
        if self.role == "generate":
            if not r.total:  # nothing to make (a prefill-only request): its prefix is kept
                self._release(rid)
                return [Emit(rid, done=True)]
            meta: dict[str, Any] = {
                "token_time": time.monotonic(),
                "index": r.made,
                "token_id": r.made % 1000,
                "text": f"{WORDS[r.made % len(WORDS)]} ",
            }
            if r.made == 0:  # what the prompt cost, as the real thinker's first token says
                meta["prefill_tokens"] = r.prompt - r.cached
                meta["cached_tokens"] = r.cached
            r.made += 1
            out = self._emits(rid, meta, 1)
            if r.made >= r.total:
                self._release(rid)
                out.append(Emit(rid, done=True))
            return out
        if self.role == "follow":
            src = min(int(r.made / self.per_input), len(r.inputs) - 1)
            if src < 0:  # the input ended empty
                self._release(rid)  # its session keeps what it prefilled
                return [Emit(rid, done=True)]
            meta = {"token_time": r.inputs[src], "index": r.made}
            r.made += 1
            out = self._emits(rid, meta, 1)
            if r.ended and r.made >= math.ceil(len(r.inputs) * self.per_input):
                self._release(rid)  # its session keeps what it prefilled
                out.append(Emit(rid, done=True))
            return out
        start, n = self._consumed(r), self._due(r)
        n = min(n, len(r.inputs) - start)
        out = []
        if n > 0:
            text = "".join(r.texts[start : start + n])
            meta = {"token_time": r.inputs[start], "index": r.made, "items": n, "text": text}
            r.made += 1
            out = self._emits(rid, meta, n)
        if r.ended and self._consumed(r) >= len(r.inputs):
            del self.reqs[rid]
            out.append(Emit(rid, done=True))
        return out

    def _emits(self, rid: str, meta: dict[str, Any], n: int) -> list[Emit]:
        emits = []
        r = self.reqs.get(rid)
        text_only = r is not None and r.meta.get("text_only")
        for target in self.targets:
            if text_only and target == self.speech_to:
                continue
            spec = self.outputs.get(target, self.outputs.get("*", {}))
            on_gpu = self.device.startswith("cuda") and target != CLIENT
            payload: Payload = dict(meta)
            for name, (dtype, dims) in spec.items():
                shape = tuple(n if d == "n" else d for d in dims)
                if self.speech is not None and target == CLIENT and dtype.startswith("float"):
                    payload[name] = self._speak(rid, shape)
                    continue
                payload[name] = self._array(dtype, shape, self.device if on_gpu else "cpu")
            emits.append(Emit(rid, payload, to=target))
        return emits

    def _speak(self, rid: str, shape: tuple[int, ...]) -> np.ndarray:
        """The request's next samples of the speech, looped."""
        assert self.speech is not None
        r, n = self.reqs[rid], math.prod(shape)
        at = np.arange(r.spoken, r.spoken + n) % len(self.speech)
        r.spoken += n
        return self.speech[at].reshape(shape)

    def _array(self, dtype: str, shape: tuple[int, ...], device: str) -> Any:
        key = (dtype, str(shape), device)
        a = self._arrays.get(key)
        if a is None:
            if len(self._arrays) > 64:  # chunk sizes vary only a little; keep the cache small
                self._arrays.clear()
            dt = dtype_of(dtype)
            if np.issubdtype(dt, np.floating):  # audible: a quiet 220 Hz tone at 24 kHz
                tone = 0.1 * np.sin(np.arange(math.prod(shape)) * (2 * np.pi * 220 / 24000))
                a = tone.astype(dt).reshape(shape)
            else:
                a = np.ones(shape, dtype=dt)
            if device == "cpu":
                a.flags.writeable = False
            else:
                from realtime_omni.pipeline.cuda_ipc import from_numpy

                a = from_numpy(a, device)
            self._arrays[key] = a
        return a


SPEECH_RATE_HZ = 24000


def _speech(stage: str, p: dict[str, Any]) -> np.ndarray | None:
    """The speech a speaking chunk stage plays (24 kHz float32), or None."""
    import hashlib
    import shutil
    import subprocess
    import wave
    from pathlib import Path

    text, path = p.get("speech_text"), p.get("speech_wav")
    if text is None and path is None:
        return None
    if path is None:
        digest = hashlib.sha256(str(text).encode()).hexdigest()[:16]
        path = Path(__file__).resolve().parents[2] / ".cache" / f"speech-{digest}.wav"
        if not path.is_file():
            if shutil.which("espeak-ng") is None:
                raise ConfigError(
                    f"stages.{stage}.params.speech_text needs espeak-ng to speak it. Fix: "
                    "apt-get install espeak-ng, or give speech_wav instead"
                )
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp.wav")
            subprocess.run(["espeak-ng", "-w", str(tmp), str(text)], check=True)
            tmp.replace(path)
    try:
        with wave.open(str(path)) as w:
            if w.getnchannels() != 1 or w.getsampwidth() != 2:
                raise ConfigError(f"stages.{stage}.params.speech_wav: {path} is not 16-bit mono")
            rate = w.getframerate()
            x = np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768
    except (OSError, EOFError, wave.Error) as e:
        raise ConfigError(f"stages.{stage}.params.speech_wav: cannot read {path}: {e}") from None
    if rate != SPEECH_RATE_HZ:
        import soxr

        x = soxr.resample(x, rate, SPEECH_RATE_HZ).astype(np.float32)
    if not len(x):
        raise ConfigError(f"stages.{stage}.params: the speech is empty")
    return x
